/* step.c — the step loop (nano-vllm's division of labour: the scheduler decides, the model runs,
 * the engine owns requests and their outputs): a step's launch (schedule, build the batch, run the
 * forward, sample, propose) and its completion on every rank, and the engine thread's loop. */
#include "engine/engine_impl.h"

#include "base/devmem.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

/* Schedules the sequences of group g (every sequence when not pipelined) into f, with the drafts
 * of decoding choices riding on them. Returns the items scheduled (0: nothing to run, f stays
 * inactive). */
static int schedule(ds_engine *e, inflight *f, int g) {
    int n_items = 0, n_pre = 0, n_forced = 0;
    ds_sched_set_group(e->sched, g, e->n_fl);
    for (int k = 0; k < e->n_forced; k++) /* (tests: the head's force_preempt answers) */
        for (request *r = e->live; r; r = r->next) {
            if (r->id != e->forced_req[k]) continue;
            const int c = e->forced_ch[k];
            choice *ch = c >= 0 && c < r->spec.params.n ? &r->choices[c] : NULL;
            if (ch && !ch->done && ch->in_sched && !ch->busy)
                n_forced += ds_sched_preempt(e->sched, ch->seq);
            break;
        }
    e->n_forced = 0;
    if (e->num_speculative_tokens) eng_attach_drafts(e);
    ds_sched_schedule(e->sched, f->items, &n_items, e->preempted, &n_pre);
    for (int i = 0; i < n_pre && e->opts.test.preempted; i++) {
        const choice *ch = e->preempted[i]->owner;
        if (ch)
            e->opts.test.preempted(e->opts.test.preempt_ctx, ch->req->id, ch->index,
                                   ch->n_generated);
    }
    if (n_pre + n_forced) {
        pthread_mutex_lock(&e->mu);
        e->stats.preemptions_total += (uint64_t)(n_pre + n_forced);
        pthread_mutex_unlock(&e->mu);
    }
    f->n_items = n_items;
    f->active = 0;
    if (!n_items && e->num_speculative_tokens) eng_detach_drafts(e);
    return n_items;
}

void eng_ask_force(ds_engine *e) {
    e->n_forced = 0;
    if (!e->opts.test.force_preempt) return;
    ds_sched_set_group(e->sched, (int)(e->micro % (uint64_t)e->n_fl), e->n_fl);
    const int n_run = ds_sched_running(e->sched, e->preempted, e->opts.max_num_seqs);
    for (int i = 0; i < n_run; i++) { /* (e->preempted is scratch until the step's plan) */
        const choice *ch = e->preempted[i]->owner;
        if (ch && !ch->busy &&
            e->opts.test.force_preempt(e->opts.test.preempt_ctx, ch->req->id, ch->index,
                                       ch->n_generated)) {
            e->forced_req[e->n_forced] = ch->req->id;
            e->forced_ch[e->n_forced++] = ch->index;
        }
    }
}

/* Grows the step's tap buffer and the draws' count buffer for f's items, before any pointer into
 * them is taken. Returns the taps this step captures (0 when the tap buffer cannot grow: the
 * draft context lags, outputs stay exact); *draws_ok = 0 when the counts' room is missing (rows
 * then come back whole and are sampled here). */
static int reserve_step_room(ds_engine *e, const inflight *f, int *draws_ok) {
    int n_taps = e->n_taps, D = ds_model_config(e->model)->hidden_size;
    size_t tap_need = 0;
    for (int i = 0; i < f->n_items; i++) tap_need += (size_t)f->items[i].n * n_taps * D;
    if (tap_need > e->taps_cap) {
        float *t = realloc(e->taps, tap_need * sizeof(float));
        if (!t) {
            if (e->dist)
                eng_dist_fatal(e, "draft taps", "out of memory"); /* the relay needs them */
            n_taps = 0;
        } else {
            e->taps = t;
            e->taps_cap = tap_need;
        }
    }
    size_t dc_need = 0;
    for (int i = 0; e->sampler && i < f->n_items; i++) {
        ds_seq *s = f->items[i].seq;
        if (f->items[i].sample) dc_need += eng_draw_counts_need(s->owner, s->n_spec + 1);
    }
    *draws_ok = 1;
    if (dc_need > e->cap_dcounts) {
        ds_token_count *dc = realloc(e->dcounts, dc_need * sizeof *dc);
        if (dc) {
            e->dcounts = dc;
            e->cap_dcounts = dc_need;
        } else {
            *draws_ok = 0;
        }
    }
    return n_taps;
}

/* Item i of f as the forward's e->batch[i]: where its logits, greedy picks or draws go, its taps
 * (at *tap_off) and, for a verify, its KDA state after each row; a sequence resumed from a
 * checkpoint gets its slot from it here. */
static void batch_item(ds_engine *e, inflight *f, int i, int n_taps, int draws_ok, size_t *tap_off,
                       size_t *dc_off) {
    const int rows = e->num_speculative_tokens + 1, D = ds_model_config(e->model)->hidden_size;
    const size_t slot_n = ds_model_slot_floats(e->model);
    ds_sched_item *it = &f->items[i];
    ds_seq *s = it->seq;
    choice *ch = s->owner;
    ch->busy = 1;
    int verify_rows = s->n_spec ? s->n_spec + 1 : 1;
    int want_logits = it->sample && e->last_stage;
    /* a greedy choice gets its tokens picked beside the logits, which then stay there; a sampled
     * one (on the sampling rank) gets them drawn there */
    int greedy = want_logits && eng_picks_greedy(e, ch);
    int drawn = want_logits && !greedy && e->sampler && draws_ok && eng_model_draws(ch);
    /* a constrained choice's rows carry its grammar's masks (V/32 words each) */
    uint32_t *allow = drawn && ch->req->spec.params.grammar ? eng_allow_rows(e, i) : NULL;
    if (drawn && ch->req->spec.params.grammar && !allow) drawn = 0;
    if (drawn) {
        eng_set_draws(e, ch, s->tokens + it->pos0 + 1, verify_rows, e->draws + (size_t)i * rows,
                      e->dcounts + *dc_off, e->dstops + (size_t)i * (DS_MAX_STOP + 1), allow);
        *dc_off += eng_draw_counts_need(ch, verify_rows);
    }
    e->batch[i] = (ds_seq_batch){
        .tokens = s->tokens + it->pos0,
        .n = it->n,
        .pos0 = it->pos0,
        .slot = ds_slot_data(e->slots, s->slot),
        .block_table = s->block_table,
        .logits = want_logits && !greedy && !drawn ? e->logits + (size_t)i * rows * e->V : NULL,
        .argmax = greedy || drawn ? e->argmax + (size_t)i * rows : NULL,
        .draws = drawn ? e->draws + (size_t)i * rows : NULL,
        .n_logits = want_logits ? verify_rows : 0,
        .tap_layers = n_taps ? e->tap_ids : NULL,
        .n_taps = n_taps,
        .taps = n_taps ? e->taps + *tap_off : NULL,
        .state_rows = s->n_spec ? f->state_rows + (size_t)i * rows * slot_n : NULL,
    };
    *tap_off += (size_t)it->n * n_taps * D;
    if (it->pos0 < s->n_prompt) f->n_prompt_tokens += DS_MIN(it->n, s->n_prompt - it->pos0);
    /* A sequence resumed from a checkpoint starts from a copy of it: before any kernel reads its
     * slot, whatever kind of step this is (prefill, decode or verify). */
    if (e->prefix && ds_prefix_would_hold(e->prefix, s, it->pos0)) {
        pthread_mutex_lock(&e->mu);
        e->stats.ckpt_holds++;
        pthread_mutex_unlock(&e->mu);
    }
    if (e->prefix && ds_prefix_take_fork(e->prefix, s, e->batch[i].slot) && s->n_spec) {
        pthread_mutex_lock(&e->mu);
        e->stats.spec_fork_verifies++;
        pthread_mutex_unlock(&e->mu);
    }
}

/* The forward's input for f's items (e->batch). */
static void build_batch(ds_engine *e, inflight *f, int n_taps, int draws_ok) {
    f->n_prompt_tokens = 0;
    size_t tap_off = 0, dc_off = 0;
    for (int i = 0; i < f->n_items; i++) batch_item(e, f, i, n_taps, draws_ok, &tap_off, &dc_off);
    eng_masks_post(e, f); /* made now, or beside the forward (mask_async) */
    f->active = 1;
}

/* Runs the forward of e->batch (this rank's stage in a job). Returns DS_ERR when it failed: in a
 * job the ranks would diverge, so that ends it; alone, only a bug can bring us here (inputs were
 * validated at submit), so the batch's requests fail rather than the server. */
static int run_forward(ds_engine *e, inflight *f) {
    ds_err err = {{0}};
    int n_items = f->n_items;
    int frc = e->dist ? ds_pp_step(e->comm, e->model, &e->kv, e->batch, n_items, &e->ppb, &err)
                      : ds_model_forward(e->model, &e->kv, e->batch, n_items, &err);
    eng_masks_wait(e); /* (a forward that drew nothing, or failed, did not wait for them) */
    if (!frc) return DS_OK;
    if (e->dist) eng_dist_fatal(e, "forward", err.msg);
    fprintf(stderr, "[deltaserve] forward failed: %s\n", err.msg);
    for (int i = 0; i < n_items; i++) {
        choice *ch = f->items[i].seq->owner;
        ch->busy = 0;
        eng_finish_choice(e, ch, DS_FINISH_ERROR);
    }
    f->active = 0;
    return DS_ERR;
}

/* One step for the sequences of group g (every sequence when not pipelined): schedule, build the
 * batch, run the forward; then the sampling rank chooses the tokens, writes the draft's context,
 * proposes the next drafts and sends the outcome. f stays inactive when there was nothing to
 * run. Returns the items planned. */
static int launch(ds_engine *e, inflight *f, int g) {
    if (e->opts.test.hold && e->opts.test.hold(e->opts.test.hold_ctx)) {
        f->n_items = 0;
        f->active = 0;
        return 0;
    }
    if (!schedule(e, f, g)) return 0;
    f->t0 = ds_now();
    int draws_ok;
    int n_taps = reserve_step_room(e, f, &draws_ok);
    build_batch(e, f, n_taps, draws_ok);
    if (run_forward(e, f) == DS_OK) {
        if (e->dist) eng_relay_taps(e, f->n_items);
        if (e->sampler) {
            eng_sample_items(e, f);
            eng_propose(e, f, n_taps);
            if (e->dist) eng_outcome_send(e, f);
        }
    }
    if (e->num_speculative_tokens) eng_detach_drafts(e);
    return f->n_items;
}

/* Requests live, and a whole round of the groups planned nothing: nothing is in flight and
 * nothing can start, which the scheduler never allows (it always plans the oldest request). After
 * DS_STALL_S of it the engine says so once, with what is held, and counts it; from then on it
 * waits 1 ms a round rather than spin a core (every rank: a job's ranks go round together). */
static void watch_idle(ds_engine *e, int planned) {
    if (planned || !e->live) {
        e->idle_launches = 0;
        e->stall_reported = 0;
        return;
    }
    if (++e->idle_launches < (uint64_t)e->n_fl) return;
    const double now = ds_now();
    if (e->idle_launches == (uint64_t)e->n_fl) e->idle_t0 = now;
    const double limit = e->opts.test.stall_seconds > 0 ? e->opts.test.stall_seconds : DS_STALL_S;
    if (!e->stall_reported && now - e->idle_t0 >= limit) {
        e->stall_reported = 1;
        int n_live = 0;
        for (request *r = e->live; r; r = r->next) n_live++;
        if (e->head)
            fprintf(stderr,
                    "[deltaserve] engine: no step planned for %.1f s while %d requests are live "
                    "(%d sequences running, %d waiting; %d of %d pages free, %d of %d state "
                    "slots): a scheduling fault; waiting 1 ms a round from now on\n",
                    now - e->idle_t0, n_live, ds_sched_n_running(e->sched),
                    ds_sched_n_waiting(e->sched), ds_page_n_free(e->pages),
                    ds_page_n_total(e->pages), ds_slot_n_free(e->slots), ds_slot_n_total(e->slots));
        pthread_mutex_lock(&e->mu);
        e->stats.stalls_total++;
        pthread_mutex_unlock(&e->mu);
    }
    if (e->stall_reported) {
        const struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}

/* Applies step f's outcome on this rank: KDA rollback and truncation of verifies, the commit,
 * prefix-cache filing, the tokens (events on the head), the next drafts. */
static void complete(ds_engine *e, inflight *f) {
    if (!f->active) return;
    f->active = 0;
    int n_items = f->n_items, rows = e->num_speculative_tokens + 1;
    size_t slot_n = ds_model_slot_floats(e->model);
    if (!e->sampler) eng_outcome_take(e, f);
    for (int i = 0; i < n_items; i++) {
        ds_sched_item *it = &f->items[i];
        ds_seq *s = it->seq;
        ((choice *)s->owner)->busy = 0;
        if (!it->sample || f->va[i] < 0) continue;
        /* a verify: roll the KDA slot back to the last accepted row and shrink the item to what
         * was accepted, so the commit below (and the prefix cache) only see accepted tokens */
        int a = f->va[i];
        eng_count_verify(e, it->n - 1, a);
        ds_dmem_copy(e->dm, ds_slot_data(e->slots, s->slot),
                     f->state_rows + ((size_t)i * rows + a) * slot_n, slot_n * sizeof(float));
        s->n_tokens = it->pos0 + 1 + a; /* the accepted drafts stay, the rest go */
        s->n_spec = 0;
        it->n = a + 1;
    }
    ds_sched_commit(e->sched, f->items, n_items);
    /* File the pages and rung checkpoints this step completed, before sampling appends tokens
     * (the slot now summarises exactly n_computed tokens). */
    if (e->prefix)
        for (int i = 0; i < n_items; i++) {
            ds_seq *s = f->items[i].seq;
            if (s->status == DS_SEQ_RUNNING)
                ds_prefix_on_computed(e->prefix, s, ds_slot_data(e->slots, s->slot));
        }
    for (int i = 0; i < n_items; i++) {
        ds_sched_item *it = &f->items[i];
        if (!it->sample) continue;
        choice *ch = it->seq->owner;
        int finished = 0, cnt = f->va[i] < 0 ? 1 : f->va[i] + 1;
        for (int j = 0; j < cnt && !finished; j++)
            finished = eng_deliver(e, ch, f->vt[i][j], &f->vlp[(size_t)i * rows + j], j < cnt - 1);
        if (finished || !e->num_speculative_tokens) continue;
        ch->n_drafts = f->n_dr[i];
        memcpy(ch->drafts, f->dr[i], (size_t)f->n_dr[i] * sizeof(int32_t));
        pthread_mutex_lock(&e->mu);
        e->stats.spec_draft_digest =
            (uint32_t)XXH64(ch->drafts, (size_t)ch->n_drafts * 4, e->stats.spec_draft_digest);
        pthread_mutex_unlock(&e->mu);
    }
    pthread_mutex_lock(&e->mu);
    e->stats.prompt_tokens_total += (uint64_t)f->n_prompt_tokens;
    e->stats.steps_total++;
    e->stats.step_seconds_total += ds_now() - f->t0;
    e->stats.grammar_mask_seconds += e->g_mask_s;
    e->stats.grammar_wait_seconds += e->g_wait_s;
    e->stats.grammar_accept_seconds += e->g_accept_s;
    e->g_mask_s = e->g_wait_s = e->g_accept_s = 0;
    pthread_mutex_unlock(&e->mu);
}

/* The step loop. Step m completes step m - n_fl (the last one of the same group) first, then takes
 * the head's plan and launches; without pipelining (n_fl = 1) every step completes right after
 * its launch. */
void *eng_main(void *arg) {
    ds_engine *e = arg;
    for (;;) {
        inflight *f = &e->fl[e->micro % (uint64_t)e->n_fl];
        complete(e, f);
        eng_retry_deferred_aborts(e);
        if (e->head && e->opts.test.step) e->opts.test.step(e->opts.test.step_ctx, e->micro);
        if (eng_take_inbox(e)) break;
        eng_update_queue_stats(e);
        watch_idle(e, launch(e, f, (int)(e->micro % (uint64_t)e->n_fl)));
        e->micro++;
        if (e->n_fl == 1) complete(e, f);
        eng_update_queue_stats(e);
    }
    eng_update_queue_stats(e);
    return NULL;
}
