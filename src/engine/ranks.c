/* ranks.c — the rank protocol of a TP x PP job: the head's step plan and the sampling rank's step
 * outcome (byte messages, point to point), the DSpark tap relays between stages, and ending the
 * job when a rank cannot go on. */
#include "engine/engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- messages of a TP x PP job ----------------------------------------------------------------
 * Two messages per step, point to point (ds_comm_post / ds_comm_take): the head's plan before the
 * step (new requests, aborts, stop; in tests the preemptions a hook forces), and the sampling
 * rank's outcome after it (per sampled item: accepted count, tokens, logprobs, then the drafts for
 * the next step). Every rank applies them in the same order, so schedulers, pools, prefix caches
 * and texts stay identical everywhere. */
enum { TAG_PLAN = 1, TAG_OUTCOME = 2 }; /* byte messages between ranks (ds_comm_post) */

typedef struct wbuf {
    char *p;
    size_t n, cap;
    int oom;
} wbuf;

static void put(wbuf *w, const void *x, size_t n) {
    if (w->oom) return;
    if (w->n + n > w->cap) {
        size_t cap = DS_MAX(2 * w->cap, w->n + n + 256);
        char *q = realloc(w->p, cap);
        if (!q) {
            w->oom = 1;
            return;
        }
        w->p = q;
        w->cap = cap;
    }
    memcpy(w->p + w->n, x, n);
    w->n += n;
}

typedef struct rbuf {
    const char *p;
    size_t n, off;
    int bad; /* read past the end: a protocol bug, ends the job */
} rbuf;

static void get(rbuf *r, void *x, size_t n) {
    if (r->bad || r->off + n > r->n) {
        r->bad = 1;
        memset(x, 0, n);
        return;
    }
    memcpy(x, r->p + r->off, n);
    r->off += n;
}

/* A lock-step job cannot go on without this rank: say why and end every rank (non-zero). */
void eng_dist_fatal(ds_engine *e, const char *what, const char *msg) {
    fprintf(stderr, "[deltaserve] %s: %s: %s\n", e->comm->who, what, msg);
    ds_comm_finish(e->comm, 1); /* aborts the job; does not return under MPI */
    abort();
}

typedef struct plan_hdr {
    int32_t stopping, abort_all, n_new, n_aborts;
    int32_t heartbeat; /* an idle head's plan: every rank answers, so a hung one is found */
    int32_t n_forced;  /* tests: preemptions the head's hook asked for (e->forced_*) */
} plan_hdr;

/* P/D (docs/pd.md): a producer's transfer id (every rank files its own part under it), then a
 * consumer's transfer {u32 present; then u32 host length, host, u64 id, u64 front length, part
 * 0's front} (every rank pulls the parts it needs itself). */
static void plan_put_kv(wbuf *w, const request *r) {
    put(w, &r->spec.kv_export_id, sizeof r->spec.kv_export_id);
    const char *host;
    uint64_t id;
    const void *front;
    size_t front_len;
    uint32_t has = (uint32_t)eng_pd_plan_info(r->kv_import, &host, &id, &front, &front_len);
    put(w, &has, sizeof has);
    if (!has) return;
    uint32_t hl = (uint32_t)strlen(host);
    uint64_t fl = front_len;
    put(w, &hl, sizeof hl);
    put(w, host, hl);
    put(w, &id, sizeof id);
    put(w, &fl, sizeof fl);
    put(w, front, front_len);
}

static void plan_read_kv(ds_engine *e, rbuf *rb, request *r) {
    get(rb, &r->spec.kv_export_id, sizeof r->spec.kv_export_id);
    uint32_t has = 0, hl = 0;
    get(rb, &has, sizeof has);
    if (rb->bad || !has) return;
    char host[256];
    get(rb, &hl, sizeof hl);
    if (hl >= sizeof host) rb->bad = 1;
    if (rb->bad) return;
    get(rb, host, hl);
    host[hl] = 0;
    uint64_t id = 0, fl = 0;
    get(rb, &id, sizeof id);
    get(rb, &fl, sizeof fl);
    if (fl > rb->n - rb->off) rb->bad = 1;
    if (rb->bad) return;
    const void *front = rb->p + rb->off;
    rb->off += (size_t)fl;
    r->kv_import = eng_pd_pull_rank(e, host, id, front, (size_t)fl, r->prompt, r->spec.n_prompt);
}

/* Head: the plan to every other rank — the requests of `in` (its own objects), the aborts ab[n_ab]
 * and the stop flags. A message to each rank rather than a broadcast: with pipelined stages the
 * ranks read a step's plan at different times, and the head must not wait for the last of them. */
static void plan_send(ds_engine *e, request *in, const int64_t *ab, int n_ab, int stopping,
                      int abort_all, int heartbeat) {
    ds_err err = {{0}};
    wbuf w = {0};
    plan_hdr h = {stopping, abort_all, 0, n_ab, heartbeat, e->n_forced};
    for (request *r = in; r; r = r->next) h.n_new++;
    put(&w, &h, sizeof h);
    for (request *r = in; r; r = r->next) {
        ds_request_params p = r->spec.params;
        for (int i = 0; i < DS_MAX_STOP; i++) p.stop[i] = NULL;
        p.grammar = NULL; /* sent as text after the stop strings */
        put(&w, &r->id, sizeof r->id);
        put(&w, &r->seed_base, sizeof r->seed_base);
        put(&w, &r->spec.n_prompt, sizeof r->spec.n_prompt);
        put(&w, &p, sizeof p);
        for (int i = 0; i < p.n_stop; i++) {
            uint32_t len = (uint32_t)strlen(r->spec.params.stop[i]);
            put(&w, &len, sizeof len);
            put(&w, r->spec.params.stop[i], len);
        }
        /* the grammar: its length + 1 then its text, or 0 for none */
        const char *gr = r->spec.params.grammar;
        uint32_t glen = gr ? (uint32_t)strlen(gr) + 1 : 0;
        put(&w, &glen, sizeof glen);
        if (glen) put(&w, gr, glen - 1);
        put(&w, r->prompt, (size_t)r->spec.n_prompt * sizeof(int32_t));
        plan_put_kv(&w, r);
    }
    put(&w, ab, (size_t)n_ab * sizeof *ab);
    put(&w, e->forced_req, (size_t)e->n_forced * sizeof *e->forced_req);
    put(&w, e->forced_ch, (size_t)e->n_forced * sizeof *e->forced_ch);
    if (w.oom) eng_dist_fatal(e, "step plan", "out of memory");
    for (int r = 1; r < e->comm->size; r++)
        if (ds_comm_post(e->comm, r, TAG_PLAN, w.p, w.n, &err))
            eng_dist_fatal(e, "step plan", err.msg);
    free(w.p);
    /* Broadcasts of a few bytes complete at the head even when a rank is stuck, so an idle head
     * would never notice: a heartbeat makes every rank broadcast in turn, and a rank that does not
     * is named by the timeout (DS_COMM_TIMEOUT_S). */
    uint64_t one = 1;
    if (heartbeat && ds_comm_min_u64(e->comm, &one, &err)) eng_dist_fatal(e, "heartbeat", err.msg);
}

/* One request of the head's plan, made as the head made it (its stop strings ours). NULL with
 * rb->bad set when the message is malformed. */
static request *plan_read_request(ds_engine *e, rbuf *rb) {
    ds_err err = {{0}};
    ds_request_spec spec = {0};
    int64_t id;
    uint64_t seed_base;
    get(rb, &id, sizeof id);
    get(rb, &seed_base, sizeof seed_base);
    get(rb, &spec.n_prompt, sizeof spec.n_prompt);
    get(rb, &spec.params, sizeof spec.params);
    if (spec.params.n_stop < 0 || spec.params.n_stop > DS_MAX_STOP) rb->bad = 1;
    for (int i = 0; i < spec.params.n_stop && !rb->bad; i++) {
        uint32_t len = 0;
        get(rb, &len, sizeof len);
        if (len > rb->n - rb->off) {
            rb->bad = 1;
            break;
        }
        spec.params.stop[i] = strndup(rb->p + rb->off, len);
        rb->off += len;
        if (!spec.params.stop[i]) eng_dist_fatal(e, "step plan", "out of memory");
    }
    uint32_t glen = 0;
    spec.params.grammar = NULL;
    if (!rb->bad) get(rb, &glen, sizeof glen);
    if (glen && glen - 1 > rb->n - rb->off) rb->bad = 1;
    if (glen && !rb->bad) {
        spec.params.grammar = strndup(rb->p + rb->off, glen - 1);
        rb->off += glen - 1;
        if (!spec.params.grammar) eng_dist_fatal(e, "step plan", "out of memory");
    }
    if (spec.n_prompt < 1 || (size_t)spec.n_prompt * sizeof(int32_t) > rb->n - rb->off) rb->bad = 1;
    if (rb->bad) return NULL;
    spec.prompt = (const int32_t *)(rb->p + rb->off); /* eng_request_new copies it */
    rb->off += (size_t)spec.n_prompt * sizeof(int32_t);
    spec.on_event = NULL;
    request *r = eng_request_new(e, &spec, id, seed_base, &err);
    if (!r) eng_dist_fatal(e, "step plan", err.msg);
    r->owns_stop = 1;
    plan_read_kv(e, rb, r);
    return r;
}

/* Another rank: waits for the head's plan and builds the same requests into *in. */
static void plan_take(ds_engine *e, request **in, int64_t *ab, int *n_ab, int *stopping,
                      int *abort_all) {
    ds_err err = {{0}};
    void *blob = NULL;
    size_t n = 0;
    if (ds_comm_take(e->comm, 0, TAG_PLAN, &blob, &n, &err))
        eng_dist_fatal(e, "step plan", err.msg);
    rbuf rb = {blob, n, 0, 0};
    plan_hdr h;
    get(&rb, &h, sizeof h);
    if (!rb.bad && h.heartbeat) {
        uint64_t one = 1;
        if (ds_comm_min_u64(e->comm, &one, &err)) eng_dist_fatal(e, "heartbeat", err.msg);
    }
    *stopping = h.stopping;
    *abort_all = h.abort_all;
    request *head = NULL, **tail = &head;
    for (int q = 0; q < h.n_new && !rb.bad; q++) {
        request *r = plan_read_request(e, &rb);
        if (!r) break;
        *tail = r;
        tail = &r->next;
    }
    *n_ab = DS_MIN(h.n_aborts, 256);
    get(&rb, ab, (size_t)*n_ab * sizeof *ab);
    if (h.n_forced < 0 || h.n_forced > e->opts.max_num_seqs) rb.bad = 1;
    e->n_forced = rb.bad ? 0 : h.n_forced;
    get(&rb, e->forced_req, (size_t)e->n_forced * sizeof *e->forced_req);
    get(&rb, e->forced_ch, (size_t)e->n_forced * sizeof *e->forced_ch);
    if (rb.bad) eng_dist_fatal(e, "step plan", "malformed message from the head");
    free(blob);
    *in = head;
}

/* Head: sends the requests of `in`, the aborts and the stop flags. Others: receive them and build
 * the same requests into *in. */
void eng_plan_exchange(ds_engine *e, request **in, int64_t *ab, int *n_ab, int *stopping,
                       int *abort_all, int heartbeat) {
    if (e->head)
        plan_send(e, *in, ab, *n_ab, *stopping, *abort_all, heartbeat);
    else
        plan_take(e, in, ab, n_ab, stopping, abort_all);
}

/* The outcome of step f, from the sampling rank to each other rank (per sampled item: accepted
 * count, tokens, logprobs, then the next drafts), as a message of its own: with pipelined stages
 * the ranks take it at different times, so no collective may carry it. It ends with the seconds
 * of constrained decoding the sampling rank spent since its last outcome (masks made, waited
 * for, tokens accepted), for the head's /metrics: a sampling rank that is not the head hands
 * them over (and counts them no more itself). */
void eng_outcome_send(ds_engine *e, inflight *f) {
    ds_err err = {{0}};
    int rows = e->num_speculative_tokens + 1;
    wbuf w = {0};
    double g[3] = {0, 0, 0};
    if (!e->head) {
        g[0] = e->g_mask_s, g[1] = e->g_wait_s, g[2] = e->g_accept_s;
        e->g_mask_s = e->g_wait_s = e->g_accept_s = 0;
    }
    for (int i = 0; i < f->n_items; i++) {
        if (!f->items[i].sample) continue;
        int cnt = f->va[i] < 0 ? 1 : f->va[i] + 1;
        put(&w, &f->va[i], sizeof f->va[i]);
        put(&w, f->vt[i], (size_t)cnt * sizeof(int32_t));
        put(&w, &f->vlp[(size_t)i * rows], (size_t)cnt * sizeof *f->vlp);
        put(&w, &f->n_dr[i], sizeof f->n_dr[i]);
        put(&w, f->dr[i], (size_t)f->n_dr[i] * sizeof(int32_t));
    }
    put(&w, g, sizeof g);
    if (w.oom) eng_dist_fatal(e, "step outcome", "out of memory");
    for (int r = 0; r < e->comm->size; r++)
        if (r != e->comm->rank && ds_comm_post(e->comm, r, TAG_OUTCOME, w.p, w.n, &err))
            eng_dist_fatal(e, "step outcome", err.msg);
    free(w.p);
}

void eng_outcome_take(ds_engine *e, inflight *f) {
    ds_err err = {{0}};
    int rows = e->num_speculative_tokens + 1;
    void *blob = NULL;
    size_t n = 0;
    if (ds_comm_take(e->comm, e->sampler_rank, TAG_OUTCOME, &blob, &n, &err))
        eng_dist_fatal(e, "step outcome", err.msg);
    rbuf rb = {blob, n, 0, 0};
    for (int i = 0; i < f->n_items && !rb.bad; i++) {
        f->va[i] = -1;
        if (!f->items[i].sample) continue;
        get(&rb, &f->va[i], sizeof f->va[i]);
        if (f->va[i] < -1 || f->va[i] > e->num_speculative_tokens) rb.bad = 1;
        int cnt = f->va[i] < 0 ? 1 : f->va[i] + 1;
        get(&rb, f->vt[i], (size_t)cnt * sizeof(int32_t));
        get(&rb, &f->vlp[(size_t)i * rows], (size_t)cnt * sizeof *f->vlp);
        get(&rb, &f->n_dr[i], sizeof f->n_dr[i]);
        if (f->n_dr[i] < 0 || f->n_dr[i] > e->num_speculative_tokens) rb.bad = 1;
        if (!rb.bad) get(&rb, f->dr[i], (size_t)f->n_dr[i] * sizeof(int32_t));
    }
    double g[3] = {0, 0, 0};
    get(&rb, g, sizeof g);
    if (rb.bad || rb.off != rb.n || !(g[0] >= 0 && g[1] >= 0 && g[2] >= 0))
        eng_dist_fatal(e, "step outcome", "malformed message");
    e->g_mask_s += g[0], e->g_wait_s += g[1], e->g_accept_s += g[2];
    free(blob);
}

static float *relay_buf(ds_engine *e, size_t n) {
    if (n > e->relay_cap) {
        float *b = realloc(e->relay, n * sizeof(float));
        if (!b) eng_dist_fatal(e, "tap relay", "out of memory");
        e->relay = b;
        e->relay_cap = n;
    }
    return e->relay;
}

/* DSpark in a pipeline job, after the forward: brings the taps of earlier stages to the draft on
 * the sampling rank, along the TP-rank-0 ranks of each stage. Partial-sum relay: every stage
 * receives the running sum of W_context[:, tap] . tap from the one before (zeros on the first),
 * adds its own taps' products and hands it on; the last stage adds its own, leaving the whole
 * context (before context_norm) in e->relay [tokens][D]. Plain relay: each earlier stage with
 * taps sends them ([its taps][tokens][D], item by item) to the last stage, which unpacks them into
 * its own tap buffer as if it had captured them. */
void eng_relay_taps(ds_engine *e, int n_items) {
    ds_comm *c = e->comm;
    int P = c->n_stages, st = c->stage, D = ds_model_config(e->model)->hidden_size;
    int j0 = e->tap_j0[st], j1 = e->tap_j1[st], n_all = e->n_tap_ids;
    if (P == 1 || c->tp_rank != 0 || !n_all) return; /* no draft taps (eng_setup_taps) */
    ds_err err = {{0}};
    size_t T = 0;
    for (int i = 0; i < n_items; i++) T += (size_t)e->batch[i].n;
    if (e->opts.draft_tap_relay == DS_RELAY_PARTIAL_SUM) {
        float *acc = relay_buf(e, T * D);
        if (st > 0) {
            if (ds_comm_recv(c, st - 1, acc, T * D, &err)) eng_dist_fatal(e, "tap relay", err.msg);
        } else {
            memset(acc, 0, T * D * sizeof(float));
        }
        ds_draft *d = e->last_stage ? e->draft : e->draft_ctx;
        if (j1 > j0) {
            size_t tap_off = 0, off = 0;
            for (int i = 0; i < n_items; i++) {
                int n = e->batch[i].n;
                if (ds_draft_context_add(d, n, j0, j1, e->taps + tap_off + (size_t)j0 * n * D,
                                         acc + off * D, &err))
                    eng_dist_fatal(e, "tap relay", err.msg);
                tap_off += (size_t)n * n_all * D;
                off += (size_t)n;
            }
        }
        if (!e->last_stage && ds_comm_send(c, st + 1, acc, T * D, &err))
            eng_dist_fatal(e, "tap relay", err.msg);
        return;
    }
    /* plain */
    if (!e->last_stage) {
        if (j1 <= j0) return;
        float *pk = relay_buf(e, (size_t)(j1 - j0) * T * D), *w = pk;
        size_t tap_off = 0;
        for (int i = 0; i < n_items; i++) {
            size_t rows = (size_t)e->batch[i].n * D;
            memcpy(w, e->taps + tap_off + (size_t)j0 * rows,
                   (size_t)(j1 - j0) * rows * sizeof(float));
            w += (size_t)(j1 - j0) * rows;
            tap_off += rows * n_all;
        }
        if (ds_comm_send(c, P - 1, pk, (size_t)(j1 - j0) * T * D, &err))
            eng_dist_fatal(e, "tap relay", err.msg);
        return;
    }
    for (int q = 0; q < P - 1; q++) {
        int a = e->tap_j0[q], b = e->tap_j1[q];
        if (b <= a) continue;
        float *pk = relay_buf(e, (size_t)(b - a) * T * D), *r = pk;
        if (ds_comm_recv(c, q, pk, (size_t)(b - a) * T * D, &err))
            eng_dist_fatal(e, "tap relay", err.msg);
        size_t tap_off = 0;
        for (int i = 0; i < n_items; i++) {
            size_t rows = (size_t)e->batch[i].n * D;
            memcpy(e->taps + tap_off + (size_t)a * rows, r, (size_t)(b - a) * rows * sizeof(float));
            r += (size_t)(b - a) * rows;
            tap_off += rows * n_all;
        }
    }
}
