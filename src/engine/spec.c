/* spec.c — speculative decoding: the proposers (n-gram prompt lookup, the DSpark draft, the test
 * oracle hook), drafts riding on sequences (attached before a step, detached when they did not
 * run, drafted at admission), the lossless verify and its accounting, and the DSpark taps (which
 * stage holds which, packing them for the draft's context). */
#include "engine/engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Which taps each stage holds ([tap_j0, tap_j1) of the ascending tap list: a stage's layers are
 * contiguous, and the embedding tap -1 is the first stage's), and what this rank needs to capture
 * and relay them. */
int eng_setup_taps(ds_engine *e, const char *dir, ds_err *err) {
    ds_draft_config dc;
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (ds_draft_config_load(path, &dc, err)) return DS_ERR;
    int nt = dc.num_target_layers, P = e->comm ? e->comm->n_stages : 1;
    if (nt < 1 || nt > DS_MAX_LAYERS + 1) return ds_errf(err, "%d taps", nt);
    memcpy(e->tap_ids, dc.target_layer_ids, (size_t)nt * sizeof(int));
    e->n_tap_ids = nt;
    for (int st = 0; st < P; st++) {
        int lo = 0, hi = ds_model_config(e->model)->num_hidden_layers;
        if (P > 1) ds_pp_stage_range(e->opts.pp_layer_counts, st, &lo, &hi);
        if (st == 0) lo = -1; /* the embedding tap */
        int j0 = 0, j1 = 0;   /* the taps are ascending: the stage's are one run of them */
        while (j0 < nt && e->tap_ids[j0] < lo) j0++;
        for (j1 = j0; j1 < nt && e->tap_ids[j1] < hi; j1++) continue;
        e->tap_j0[st] = j0;
        e->tap_j1[st] = j1;
    }
    int stage = e->comm ? e->comm->stage : 0, tp = e->comm ? e->comm->tp_rank : 0;
    int own = e->tap_j1[stage] > e->tap_j0[stage];
    /* The sampling rank captures its own taps (and, relayed plainly, holds everyone's); an earlier
     * stage's TP rank 0 captures its own for the relay (its TP peers hold the same stream). */
    e->n_taps = e->sampler || (tp == 0 && own) ? nt : 0;
    if (e->dist && P > 1 && tp == 0 && !e->last_stage &&
        e->opts.draft_tap_relay == DS_RELAY_PARTIAL_SUM &&
        ds_draft_load_context_only(dir, e->model, &e->draft_ctx, err))
        return DS_ERR;
    return DS_OK;
}

/* Prompt lookup: the continuation that followed the latest earlier occurrence of the sequence's
 * last n tokens (n = 3, 2, 1), up to num_speculative_tokens of them. */
static int ngram_propose(const int32_t *t, int n_tokens, int num_speculative_tokens, int32_t *out) {
    for (int n = 3; n >= 1; n--) {
        if (n_tokens <= n) continue;
        const int32_t *tail = t + n_tokens - n;
        for (int at = n_tokens - n - 1; at >= 0; at--) {
            if (memcmp(t + at, tail, (size_t)n * sizeof *t)) continue;
            int m = 0;
            while (m < num_speculative_tokens && at + n + m < n_tokens) {
                out[m] = t[at + n + m];
                m++;
            }
            if (m > 0) return m;
        }
    }
    return 0;
}

/* Drafts a choice's sequence may carry now: room for them and the token after them, within the
 * request's limits. */
static int draft_room(const request *r, const choice *ch, const ds_seq *s) {
    return DS_MIN(s->max_len - s->n_tokens - 1, r->spec.params.max_tokens - ch->n_generated - 1);
}

/* Appends up to n drafts behind s's last token; s->n_spec = how many went on. */
static void append_drafts(ds_seq *s, const int32_t *drafts, int n) {
    ds_err err;
    int j = 0;
    while (j < n && ds_seq_append(s, drafts[j], &err) == DS_OK) j++;
    s->n_spec = j;
}

/* The scheduler's admission hook (ds_sched_set_admit_drafts): q resumes one token short of its
 * end, so its first step can be a verify — the step that also forks its checkpoint. Drafts come
 * from what every rank of a job can reproduce: the choice's own pending drafts (a decode that was
 * preempted keeps the ones proposed after its last token) or a draft-free method (n-gram, the test
 * oracle). A DSpark draft needs the last token's taps, which no step has computed yet. */
int eng_admit_drafts(void *ctx, ds_seq *q) {
    ds_engine *e = ctx;
    choice *ch = q->owner;
    int room = DS_MIN(draft_room(ch->req, ch, q), e->num_speculative_tokens);
    if (room <= 0) return 0;
    int32_t d[DS_MAX_SPEC];
    int n = 0;
    if (ch->n_drafts)
        memcpy(d, ch->drafts, (size_t)(n = ch->n_drafts) * sizeof *d);
    else if (e->opts.test.spec_drafts)
        n = e->opts.test.spec_drafts(e->opts.test.spec_ctx, q->tokens, q->n_tokens,
                                     e->num_speculative_tokens, d);
    else if (e->opts.speculative_method == DS_SPEC_NGRAM)
        n = ngram_propose(q->tokens, q->n_tokens, e->num_speculative_tokens, d);
    append_drafts(q, d, DS_MIN(DS_MAX(n, 0), room));
    return q->n_spec;
}

/* Puts each decoding choice's drafts behind its last token, as many as its limits allow. */
void eng_attach_drafts(ds_engine *e) {
    for (request *r = e->live; r; r = r->next)
        for (int i = 0; i < r->spec.params.n; i++) {
            choice *ch = &r->choices[i];
            ds_seq *s = ch->seq;
            if (ch->done || ch->busy || !s || !ch->in_sched || s->status != DS_SEQ_RUNNING ||
                !ch->n_drafts || s->n_computed != s->n_tokens - 1)
                continue;
            append_drafts(s, ch->drafts, DS_MIN(ch->n_drafts, draft_room(r, ch, s)));
        }
}

/* Drops drafts that did not run this step (their sequence was not scheduled). */
void eng_detach_drafts(ds_engine *e) {
    for (request *r = e->live; r; r = r->next)
        for (int i = 0; i < r->spec.params.n; i++) {
            ds_seq *s = r->choices[i].seq;
            /* a choice in flight keeps its drafts: its step's outcome settles them */
            if (!r->choices[i].done && !r->choices[i].busy && s && s->n_spec) {
                s->n_tokens -= s->n_spec;
                s->n_spec = 0;
            }
        }
}

/* Verify (docs/model.md §8.8): sample every row in order with the request's own sampler; a draft
 * is accepted while it equals the token sampled at its row. Sampling each row exactly as plain
 * decoding would is the lossless rule for drafts proposed deterministically: it accepts draft d
 * with probability p(d) and otherwise draws from p without d. Greedy is the same rule at T = 0,
 * so greedy output equals plain decoding. Returns the accepted count a; toks[0..a] are the
 * tokens to deliver (a accepted drafts and the correction or bonus). */
int eng_verify(ds_engine *e, choice *ch, ds_sched_item *it, float *rows, const int32_t *picks,
               int drawn, ds_sample_scratch *sc, int32_t *toks, ds_logprobs_out *lps) {
    ds_seq *s = it->seq;
    int n_drafts = s->n_spec, a = 0;
    for (;;) {
        toks[a] = eng_choose(e, ch, rows ? rows + (size_t)a * e->V : NULL, picks ? picks + a : NULL,
                             drawn, sc, a, &lps[a]);
        if (a == n_drafts || toks[a] != s->tokens[it->pos0 + 1 + a]) break;
        a++;
    }
    return a;
}

void eng_count_verify(ds_engine *e, int n_drafts, int a) {
    pthread_mutex_lock(&e->mu);
    e->stats.spec_verifies++;
    e->stats.spec_draft_tokens += (uint64_t)n_drafts;
    e->stats.spec_accepted_tokens += (uint64_t)a;
    e->stats.spec_emitted_tokens += (uint64_t)a + 1;
    for (int i = 0; i < a; i++) e->stats.spec_accepted_at[i]++;
    pthread_mutex_unlock(&e->mu);
}

/* Taps of item rows [0, n_keep) packed as [n_taps][n_keep][D] at the start of its buffer. */
static void pack_taps(float *taps, int n_taps, int n, int n_keep, int D) {
    for (int j = 1; j < n_taps && n_keep < n; j++)
        memmove(taps + (size_t)j * n_keep * D, taps + (size_t)j * n * D,
                (size_t)n_keep * D * sizeof(float));
}

/* The drafts for a choice after its step: the tokens it has once the outcome is applied are
 * tokens[0 .. n_keep) and then `next`. Proposed by the sampling rank at launch, so that they can
 * travel with the outcome. */
static int draft_after(ds_engine *e, ds_seq *s, const ds_sched_item *it, int n_keep, int32_t next,
                       int32_t *out) {
    int len = it->pos0 + n_keep + 1;
    if ((size_t)len > e->after_cap) { /* grown, not allocated per call: this runs every step */
        int32_t *b = realloc(e->after, (size_t)len * sizeof *b);
        if (!b) return 0; /* no drafts: costs speed, never output */
        e->after = b;
        e->after_cap = (size_t)len;
    }
    int32_t *t = e->after;
    memcpy(t, s->tokens, (size_t)(len - 1) * sizeof *t);
    t[len - 1] = next;
    int n = e->opts.test.spec_drafts ? e->opts.test.spec_drafts(e->opts.test.spec_ctx, t, len,
                                                                e->num_speculative_tokens, out)
                                     : ngram_propose(t, len, e->num_speculative_tokens, out);
    return DS_MAX(0, DS_MIN(n, e->num_speculative_tokens));
}

/* Item i's part of a step's drafting, once its tokens are chosen: its draft context write (the
 * positions kept: a verify only its accepted ones; later ones are rewritten when they are
 * recomputed), and its next drafts — gathered for one DSpark proposal pass, or proposed here.
 * tap_off / off: where its taps and its relayed partial sum start. */
static void propose_item(ds_engine *e, inflight *f, int i, int n_taps, int summed, size_t tap_off,
                         size_t off, int *n_ctx, int *n_prop) {
    const int D = ds_model_config(e->model)->hidden_size;
    ds_sched_item *it = &f->items[i];
    ds_seq *s = it->seq;
    int n_run = e->batch[i].n;
    f->n_dr[i] = 0;
    int n_keep = f->va[i] >= 0 ? f->va[i] + 1 : it->n;
    if (n_taps && e->draft) {
        ds_draft_ctx_write *cw = &e->ctx_w[(*n_ctx)++];
        *cw = (ds_draft_ctx_write){s->block_table, it->pos0, n_keep, NULL, NULL};
        if (summed) {
            cw->sum = e->relay + off * D;
        } else {
            pack_taps(e->taps + tap_off, n_taps, n_run, n_keep, D);
            cw->taps = e->taps + tap_off;
        }
    }
    /* a P/D producer keeps the draft's context rows (its pages must match the consumer's) but
     * never proposes: it only prefills (docs/pd.md) */
    if (!it->sample || !e->num_speculative_tokens || e->opts.kv_role == DS_KV_PRODUCER) return;
    int32_t next = f->vt[i][f->va[i] < 0 ? 0 : f->va[i]];
    if (e->draft && !e->opts.test.spec_drafts) { /* proposed by eng_propose, all together */
        e->prop_item[*n_prop] = i;
        e->prop_table[*n_prop] = s->block_table;
        e->prop_p[*n_prop] = it->pos0 + n_keep - 1; /* the last context row */
        e->prop_anchor[(*n_prop)++] = next;
    } else {
        f->n_dr[i] = draft_after(e, s, it, n_keep, next, f->dr[i]);
    }
}

void eng_propose(ds_engine *e, inflight *f, int n_taps) {
    const int D = ds_model_config(e->model)->hidden_size;
    int summed =
        e->dist && e->comm->n_stages > 1 && e->opts.draft_tap_relay == DS_RELAY_PARTIAL_SUM;
    ds_err err = {{0}};
    size_t tap_off = 0, off = 0;
    int n_prop = 0, n_ctx = 0; /* DSpark proposals and context writes gathered */
    for (int i = 0; i < f->n_items; i++) {
        propose_item(e, f, i, n_taps, summed, tap_off, off, &n_ctx, &n_prop);
        tap_off += (size_t)e->batch[i].n * n_taps * D;
        off += (size_t)e->batch[i].n;
    }
    /* the context rows of every item together, before any drafts from them */
    if (n_ctx && ds_draft_write_context_batch(e->draft, &e->dcache, n_ctx, e->ctx_w, &err))
        fprintf(stderr, "[deltaserve] draft context: %s\n", err.msg);
    /* The DSpark proposals of every sampled item in as few passes as the draft cache's spare
     * slots allow: each item's context rows were written above, and a proposal reads only its
     * own sequence's rows. */
    for (int c0 = 0, m; c0 < n_prop; c0 += m) {
        m = DS_MIN(n_prop - c0, e->dcache.max_seqs);
        int rc = ds_draft_propose_batch(e->draft, &e->dcache, m, e->prop_table + c0, e->prop_p + c0,
                                        e->prop_anchor + c0, e->num_speculative_tokens,
                                        e->prop_drafts, NULL, &err);
        if (rc) fprintf(stderr, "[deltaserve] draft: %s\n", err.msg); /* speed, not output */
        for (int j = 0; j < m; j++) {
            int i = e->prop_item[c0 + j];
            f->n_dr[i] = rc ? 0 : e->num_speculative_tokens;
            if (!rc)
                memcpy(f->dr[i], e->prop_drafts + (size_t)j * e->num_speculative_tokens,
                       (size_t)e->num_speculative_tokens * sizeof(int32_t));
        }
    }
}
