/* request.c — requests and their choices: submit and abort (any thread, through the inbox under
 * the engine's lock), the engine thread taking the inbox into the scheduler, a request's lifetime,
 * deferred aborts of requests with a step in flight, and the events a choice sends its client. */
#include "engine/engine_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *ds_finish_name(ds_finish f) {
    switch (f) {
    case DS_FINISH_STOP:
        return "stop";
    case DS_FINISH_LENGTH:
        return "length";
    case DS_FINISH_ABORT:
        return "abort";
    case DS_FINISH_ERROR:
        return "error";
    default:
        return "none";
    }
}

/* ---- events ---------------------------------------------------------------------------------- */

void eng_emit(choice *ch, int32_t token, const char *text, size_t len, const ds_logprobs_out *lp,
              ds_finish finish) {
    request *r = ch->req;
    ds_token_event ev = {0};
    ev.index = ch->index;
    ev.token = token;
    ev.text = text ? text : "";
    ev.text_len = text ? len : 0;
    if (lp && r->spec.params.logprobs >= 0 && token >= 0) {
        ev.logprob = lp->logprob;
        ev.n_top = lp->n_top;
        ev.top_ids = lp->top_ids;
        ev.top_logprobs = lp->top_logprobs;
    }
    ev.finish = finish;
    ev.n_prompt = r->spec.n_prompt;
    ev.n_generated = ch->n_generated;
    if (r->spec.on_event) r->spec.on_event(r->spec.user, &ev); /* NULL: mirrored on a non-head */
}

void eng_request_free(request *r) {
    if (!r) return;
    for (int i = 0; i < r->spec.params.n; i++) {
        choice *ch = &r->choices[i];
        if (ch->seq) ds_seq_free(ch->seq);
        ds_token_counts_free(&ch->counts);
        ds_textout_free(&ch->text);
        ds_matcher_free(ch->gm);
        free(ch->gmask);
    }
    free(r->choices);
    free(r->prompt);
    ds_kv_pull_free(r->kv_import);
    if (r->owns_stop) {
        for (int i = 0; i < r->spec.params.n_stop; i++) free(r->spec.params.stop[i]);
        free(r->spec.params.grammar);
    }
    free(r);
}

/* Ends a choice: removes its sequence, flushes held text, sends the final event. When the last
 * choice ends, the request leaves the live list and is freed. */
void eng_finish_choice(ds_engine *e, choice *ch, ds_finish why) {
    if (ch->done) return;
    ch->done = 1;
    if (ch->seq) {
        /* a finished prefix is worth keeping beyond the device pools */
        if (ch->in_sched && e->prefix && why != DS_FINISH_ABORT)
            ds_prefix_on_finish(e->prefix, ch->seq);
        /* a P/D producer's prefill: its blocks, held for the consumer, before the final event
         * (so the transfer exists once the client hears the request ended) */
        if (ch->in_sched && (why == DS_FINISH_STOP || why == DS_FINISH_LENGTH))
            eng_pd_export(e, ch);
        if (ch->in_sched)
            ds_sched_remove(e->sched, ch->seq,
                            why == DS_FINISH_ABORT ? DS_SEQ_ABORTED : DS_SEQ_FINISHED);
        ds_seq_free(ch->seq);
        ch->seq = NULL;
    }
    const char *tail = NULL;
    size_t tail_len = 0;
    if (why != DS_FINISH_ABORT) ds_textout_flush(&ch->text, &tail, &tail_len);
    eng_emit(ch, -1, tail, tail_len, NULL, why);
    request *r = ch->req;
    pthread_mutex_lock(&e->mu);
    e->stats.finished[why]++;
    pthread_mutex_unlock(&e->mu);
    if (++r->n_done == r->spec.params.n) {
        for (request **p = &e->live; *p; p = &(*p)->next)
            if (*p == r) {
                *p = r->next;
                break;
            }
        eng_request_free(r);
    }
}

void eng_abort_request(ds_engine *e, request *r) {
    int n = r->spec.params.n;
    for (int i = 0; i < n; i++) {
        if (r->choices[i].done) continue;
        /* finishing the last open choice frees r: decide before, never read r after */
        int last = r->n_done == n - 1;
        eng_finish_choice(e, &r->choices[i], DS_FINISH_ABORT);
        if (last) return;
    }
}

/* ---- submit / abort (any thread) --------------------------------------------------------------
 */

/* A request with its choices and their sequences (prompt copied); id and seed fixed by the caller.
 * The head makes one per submit; the other ranks of a job make the same from the step plan. */
request *eng_request_new(ds_engine *e, const ds_request_spec *spec, int64_t id, uint64_t seed_base,
                         ds_err *err) {
    const ds_request_params *p = &spec->params;
    request *r = ds_calloc(1, sizeof *r, err);
    if (!r) return NULL;
    r->spec = *spec;
    r->kv_import = spec->kv_import; /* owned from here (eng_request_free frees it) */
    r->spec.kv_import = NULL;
    r->id = id;
    r->seed_base = seed_base;
    r->prompt = ds_malloc((size_t)spec->n_prompt * sizeof(int32_t), err);
    r->choices = ds_calloc((size_t)p->n, sizeof(choice), err);
    if (!r->prompt || !r->choices) {
        r->kv_import = NULL; /* not taken: the caller frees it */
        eng_request_free(r);
        return NULL;
    }
    memcpy(r->prompt, spec->prompt, (size_t)spec->n_prompt * sizeof(int32_t));
    r->spec.prompt = r->prompt;
    int max_len = spec->n_prompt + p->max_tokens;
    if (max_len > e->max_model_len) max_len = e->max_model_len;
    for (int i = 0; i < p->n; i++) {
        choice *ch = &r->choices[i];
        ch->req = r;
        ch->index = i;
        ds_rng_seed(&ch->rng, seed_base + (uint64_t)i);
        ch->seq = ds_seq_new(id, r->prompt, spec->n_prompt, max_len, err);
        if (!ch->seq || ds_token_counts_init(&ch->counts, err) ||
            ds_textout_init(&ch->text, p->stop, p->n_stop, err)) {
            r->kv_import = NULL;
            eng_request_free(r);
            return NULL;
        }
        ch->seq->owner = ch;
    }
    return r;
}

static int64_t submit(ds_engine *e, const ds_request_spec *spec, int *why, int *taken,
                      ds_err *err) {
    int dummy;
    if (!why) why = &dummy;
    *why = DS_SUBMIT_INVALID;
    const ds_request_params *p = &spec->params;
    if (spec->n_prompt < 1) return ds_errf(err, "the prompt is empty"), -1;
    if (p->n < 1 || p->max_tokens < 1 || p->n_stop > DS_MAX_STOP ||
        p->n_stop_token_ids > DS_MAX_STOP || p->logprobs > DS_MAX_LOGPROBS || !spec->on_event)
        return ds_errf(err, "invalid request parameters"), -1;
    for (int i = 0; i < spec->n_prompt; i++)
        if (spec->prompt[i] < 0 || spec->prompt[i] >= e->V)
            return ds_errf(err, "prompt token %d at index %d is outside [0, %d)", spec->prompt[i],
                           i, e->V),
                   -1;
    if (spec->n_prompt >= e->max_model_len)
        return ds_errf(err,
                       "the prompt has %d tokens; this model's maximum context length is %d "
                       "tokens (room is needed for at least one generated token)",
                       spec->n_prompt, e->max_model_len),
               -1;
    pthread_mutex_lock(&e->mu);
    int64_t id = e->next_id++;
    uint64_t seed_base =
        p->has_seed ? p->seed : e->opts.seed ^ (uint64_t)id * 0x9e3779b97f4a7c15ull;
    pthread_mutex_unlock(&e->mu);
    request *r = eng_request_new(e, spec, id, seed_base, err);
    *taken = r != NULL;
    if (!r) return -1;
    pthread_mutex_lock(&e->mu);
    if (e->stopping || e->n_queued >= e->opts.max_queue) {
        int stopping = e->stopping;
        pthread_mutex_unlock(&e->mu);
        eng_request_free(r);
        *why = DS_SUBMIT_FULL;
        return ds_errf(err, stopping ? "the server is shutting down"
                                     : "the request queue is full; retry later"),
               -1;
    }
    r->id = id;
    if (e->inbox_tail)
        e->inbox_tail->next = r;
    else
        e->inbox = r;
    e->inbox_tail = r;
    e->n_queued++;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    *why = 0;
    return id;
}

/* The engine owns spec->kv_import from here, whatever happens to the request. */
int64_t ds_engine_submit(ds_engine *e, const ds_request_spec *spec, int *why, ds_err *err) {
    int taken = 0;
    int64_t id = submit(e, spec, why, &taken, err);
    if (!taken) ds_kv_pull_free(spec->kv_import);
    return id;
}

void ds_engine_abort(ds_engine *e, int64_t id) {
    pthread_mutex_lock(&e->mu);
    if (e->n_aborts == e->cap_aborts) {
        int cap = e->cap_aborts ? 2 * e->cap_aborts : 64;
        int64_t *n = realloc(e->aborts, (size_t)cap * sizeof *n);
        if (!n) { /* cannot record it: the request simply runs to completion */
            pthread_mutex_unlock(&e->mu);
            return;
        }
        e->aborts = n;
        e->cap_aborts = cap;
    }
    e->aborts[e->n_aborts++] = id;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

static int request_busy(const request *r) {
    for (int i = 0; i < r->spec.params.n; i++)
        if (r->choices[i].busy) return 1;
    return 0;
}

/* Aborts request `id` now, or (a step of it is in flight) once that step completes: the same
 * decision on every rank, so the ranks stay in step. Unknown ids are ignored. */
static void abort_or_defer(ds_engine *e, int64_t id) {
    for (request *r = e->live; r; r = r->next) {
        if (r->id != id) continue;
        if (!request_busy(r)) {
            eng_abort_request(e, r);
        } else {
            if (e->n_deferred == e->cap_deferred) {
                int cap = e->cap_deferred ? 2 * e->cap_deferred : 16;
                int64_t *d = realloc(e->deferred, (size_t)cap * sizeof *d);
                if (!d) return; /* cannot keep it: the request runs to its end */
                e->deferred = d;
                e->cap_deferred = cap;
            }
            e->deferred[e->n_deferred++] = id;
        }
        return;
    }
}

void eng_retry_deferred_aborts(ds_engine *e) {
    int n = e->n_deferred;
    e->n_deferred = 0;
    for (int i = 0; i < n; i++) abort_or_defer(e, e->deferred[i]);
}

/* Moves the inbox into the scheduler and applies aborts. Returns 1 when the engine should exit. */
int eng_take_inbox(ds_engine *e) {
    request *in = NULL;
    int n_ab = 0, stopping = 0, abort_all = 0, heartbeat = 0;
    int64_t ab[256];
    if (e->head) {
        pthread_mutex_lock(&e->mu);
        for (;;) {
            int idle = !e->inbox && !e->n_aborts && !e->live;
            if (!idle || e->stopping) break;
            if (!e->dist) {
                pthread_cond_wait(&e->wake, &e->mu);
                continue;
            }
            /* In a job an idle head still sends an (empty) plan every second: the other ranks'
             * waits stay short, so DS_COMM_TIMEOUT_S can tell a hung rank from an idle server. */
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1;
            if (pthread_cond_timedwait(&e->wake, &e->mu, &until) == ETIMEDOUT) {
                heartbeat = !e->inbox && !e->n_aborts && !e->live && !e->stopping;
                break;
            }
        }
        in = e->inbox;
        e->inbox = e->inbox_tail = NULL;
        n_ab = DS_MIN(e->n_aborts, 256);
        if (n_ab) { /* e->aborts is NULL until the first abort: memcpy(NULL, 0) is UB */
            memcpy(ab, e->aborts, (size_t)n_ab * sizeof *ab);
            memmove(e->aborts, e->aborts + n_ab, (size_t)(e->n_aborts - n_ab) * sizeof *ab);
            e->n_aborts -= n_ab;
        }
        stopping = e->stopping;
        abort_all = stopping && ds_now() >= e->stop_deadline;
        pthread_mutex_unlock(&e->mu);
        eng_ask_force(e);
    }
    /* In a job the other ranks wait here for the head's plan (idle ranks included). */
    if (e->dist) eng_plan_exchange(e, &in, ab, &n_ab, &stopping, &abort_all, heartbeat);

    while (in) {
        request *r = in;
        in = in->next;
        r->next = e->live;
        e->live = r;
        eng_pd_install(e, r); /* pulled blocks into the tier, for its prefix lookup */
        int n = r->spec.params.n;
        for (int i = 0; i < n; i++) {
            ds_err err;
            choice *ch = &r->choices[i];
            if (ds_sched_add(e->sched, ch->seq, &err) == DS_OK) {
                ch->in_sched = 1;
            } else {
                /* cannot ever fit the pools: fail this choice cleanly */
                ds_seq_free(ch->seq);
                ch->seq = NULL;
                int last = r->n_done == n - 1; /* then eng_finish_choice frees r */
                eng_finish_choice(e, ch, DS_FINISH_ERROR);
                if (last) break;
            }
        }
    }
    for (int a = 0; a < n_ab; a++) abort_or_defer(e, ab[a]);
    if (abort_all) /* aborting frees r (and only r): take its successor first */
        for (request *r = e->live, *next; r; r = next) {
            next = r->next;
            abort_or_defer(e, r->id);
        }
    return stopping && !e->live;
}
