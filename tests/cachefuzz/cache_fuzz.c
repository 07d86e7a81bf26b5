/* cache_fuzz.c — randomized differential testing of the prefix cache and the offload tiers
 * (issue 30; docs/prefix-cache.md states the contract it checks).
 *
 * Each seed draws an engine configuration (block size, step budget, rung spacing, tiny page,
 * checkpoint and RAM pools, which offload tiers, a forced short hash, speculation) and a workload
 * (requests sharing prefixes of random lengths around page, chunk and rung boundaries, exact
 * repeats, extensions, multi-turn follow-ups built from an earlier answer, greedy and seeded
 * sampled requests, n = 2, logprobs, aborts), runs the workload on an engine with prefix caching
 * and then every request again, alone, on a cold engine (no prefix cache, no tier, ample pools),
 * and compares each choice token for token and its logprobs bit for bit.
 *
 * Arrivals and aborts are keyed to engine steps through the engine's test step hook, so a seed
 * replays the same interleaving every time: a failing seed is a reproducible case, saved as a
 * one-line file of arguments (--save-dir) and replayed with --case FILE.
 *
 * Pools are sized so that nothing is preempted (a preempted sequence recomputes its generated
 * tokens as a prompt, which the contract does not make bit-exact against a run that was not
 * preempted; the run fails if one happens) — except in the share of seeds --preempt PCT gives a
 * page pool of one longest sequence and a few pages (a count: ds_test_hooks.max_pages), where the
 * cached engine's preemptions are recorded (request, choice, tokens generated) and the cold run
 * replays each at the same point (ds_sched_preempt through the force_preempt test hook), without
 * speculation so that it passes every point: its recompute is cut where the cached one's was, so
 * every choice must still agree bit for bit, and every recorded preemption must have been replayed.
 *
 * With --pd PCT (one process or -pp: the producer is one process, whose sums a tensor-parallel
 * consumer's differ from), that share of the seeds also runs P/D disaggregation (docs/pd.md):
 * a producer engine (its own block size and rung spacing one time in five, so that some
 * transfers must be refused, and one time in three its own step budget) prefills some of the
 * workload's prompts as vllm-router's first request does (one token, a transfer filed), and the
 * cached engine, a consumer, pulls them before it starts and receives them into its offload tier as
 * its requests are admitted, among the rest of the workload: every choice must still equal the cold
 * run's, no transfer may be refused where the two cut prompts alike, and the producer must hold no
 * transfer at the end. Under -pp every consumer rank pulls its own stages' part.
 *
 * With --restart PCT that share of the seeds (not P/D) stops the cached engine once a random
 * number of the requests have ended and starts another with the same options for the rest, as a
 * server restarted on its tiers: its disk and Redis tiers hold what the first one stored, and
 * every choice must still equal the cold run's.
 *
 * With --grammar PCT that share of the requests is constrained by one of a few Lark grammars
 * (constrained decoding, docs/structured-outputs.md), and half the seeds that have any make the
 * cached engine's masks on its mask thread beside the forward (what it does on a GPU); the cold
 * run makes them before the forward.
 *
 * Usage: cache_fuzz [--model DIR] [--seeds N] [--seed0 S] [--redis redis://h:p] [-tp T] [-pp P]
 *                   [--pd PCT] [--grammar PCT] [--preempt PCT] [--restart PCT]
 *                   [--device cpu|cuda] [--batch-invariant] [--quantization ptpc_fp8]
 *                   [--kv-cache-dtype auto|fp8|bf16|mixed] [--experts bf16|mxfp4]
 *                   [--save-dir DIR] [--case FILE]
 *                   [--work-dir DIR] [--max-seconds S] [--verbose]
 * Exit status 0 when every seed agreed and the run exercised hits, tier loads and evictions. */
#include "transport/comm.h"
#include "transport/launch.h"
#include "parallel/pipeline.h"
#include "engine/engine.h"
#include "devtools/init_model.h"
#include "model/model.h"
#include "kernels/shared/kv_row.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define MAX_REQS  24
#define MAX_GEN   24
#define MAX_N     2
#define MAX_TOP   3
#define MAX_PLEN  300
#define MODEL_LEN 384
#define VOCAB_USE 700 /* prompt ids below the tiny models' special tokens */
#define MAX_PRE   64  /* distinct preemption points recorded per choice */
/* Steps and seconds without a token or an end for any outstanding request before a seed is called
 * stalled: far more than the longest prompt's chunks take (a stalled engine spins through
 * thousands of empty steps a second) */
#define STALL_STEPS 200000
#define STALL_S     10.0

/* ---- the run's options ------------------------------------------------------------------------
 */

typedef struct fz_opts {
    const char *model;
    int seeds;
    uint64_t seed0;
    const char *redis;
    int tp, pp;
    int device, batch_invariant;
    int quantization; /* DS_QUANT_*: the invariants hold with quantized weights too */
    int kv_dtype;     /* and with a quantized latent cache (DS_KV_*; -1 "mixed": drawn a seed) */
    int mxfp4;        /* the made model's routed experts in MXFP4, as Kimi-K3 ships them */
    const char *save_dir, *work_dir;
    int verbose;
    double max_seconds; /* > 0: start no seed after this long (the run reports what it did) */
    int pd;             /* percent of seeds that also run P/D (the producer one process) */
    int preempt;        /* percent of seeds whose cached engine runs short of pages */
    int restart;        /* percent of seeds whose cached engine is restarted halfway (not P/D) */
    int grammar;        /* percent of requests constrained by a grammar */
    int counts[DS_MAX_LAYERS];
} fz_opts;

/* ---- a seed's configuration and workload ------------------------------------------------------
 */

typedef struct fz_cfg {
    int block_size, max_batched, max_seqs, interval, ckpt_slots, extra_pages;
    int ram, disk, remote; /* tiers */
    size_t ram_pages;      /* RAM tier budget in pages */
    size_t disk_pages;     /* disk tier budget in pages (0: unlimited) */
    int hash_bits;
    int spec, k;
    /* P/D: on for this seed; the producer's block size, rung spacing and step budget */
    int pd, pd_block, pd_interval, pd_batched;
    int async_masks;            /* the cached engine's grammar masks beside the forward */
    int preempt, preempt_pages; /* pages past one longest sequence when preempting */
    /* > 0: once requests [0, restart_at) have ended, the cached engine is stopped and a new one
     * with the same options takes the rest: its disk and Redis tiers kept, the RAM tier and the
     * device pools gone (a server restarted on the same tiers) */
    int restart_at;
    int kv_dtype; /* DS_KV_*: the latent cache's rows, the same for every engine of the seed */
} fz_cfg;

typedef struct fz_out {
    int32_t tok[MAX_GEN];
    uint32_t lp[MAX_GEN]; /* logprob bits */
    int32_t top_id[MAX_GEN][MAX_TOP];
    uint32_t top_lp[MAX_GEN][MAX_TOP];
    int n_top[MAX_GEN];
    int n;
    ds_finish finish;
} fz_out;

typedef struct fz_req {
    int32_t prompt[MAX_PLEN + MAX_GEN + 32];
    int n_prompt;
    int base; /* multi-turn: the request whose prompt and answer open this one; -1 none */
    int32_t extra[32];
    int n_extra;     /* multi-turn: tokens after the earlier answer */
    int at;          /* steps after the previous arrival (0: the same step) */
    int max_len;     /* the most tokens one of its sequences can hold (prompt bound + max_tokens) */
    int abort_in;    /* steps after submission to abort it; -1 never */
    int pd;          /* P/D: its prompt prefilled by the producer, pulled by the consumer */
    ds_kv_pull *imp; /* the pull, until submit takes it */
    const char *grammar; /* constrained decoding's Lark grammar (NULL: none) */
    ds_request_params p;
    /* preemption seeds: the cached run's preemptions of each choice, in order, as runs of equal
     * points (tokens generated then, how many times in a row); the cold run's replay cursor */
    int pre_at[MAX_N][MAX_PRE], pre_cnt[MAX_N][MAX_PRE], n_pre[MAX_N];
    int pre_next[MAX_N], pre_used[MAX_N];
    int pre_overflow;
    /* run state */
    int64_t id;
    int submitted, done, aborted_sent;
    uint64_t submit_step;
    fz_out out[MAX_N];
    int n_done;
} fz_req;

typedef struct fz_work {
    fz_cfg cfg;
    uint64_t seed;
    int pd_refused;    /* P/D pulls the consumer refused */
    char pd_why[1024]; /* the first one's reason (a ds_err message) */
    fz_req r[MAX_REQS];
    int n;
    /* driving */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ds_engine *e;
    int next;          /* next request to submit */
    int outstanding;   /* submitted, not done */
    uint64_t last_arr; /* step of the last arrival */
    int alone;         /* the cold run: one request at a time */
    int finished_all;
    int first, n_limit; /* requests [first, n_limit) are the current engine's (ids restart with
                           each engine: a hook's request id means one of these) */
    fz_req *cur;        /* alone: the request running */
    /* a stall: steps go on while no outstanding request gets a token or its end (a request the
     * engine lost, or two waiting on each other's pages) */
    uint64_t progress, progress_step;
    double progress_t;
    int stalled;
} fz_work;

static uint64_t rnd(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rint_(uint64_t *s, int lo, int hi) { /* [lo, hi] */
    return lo + (int)(rnd(s) % (uint64_t)(hi - lo + 1));
}
static int chance(uint64_t *s, int pct) {
    return (int)(rnd(s) % 100) < pct;
}

static void draw_cfg(uint64_t *s, const fz_opts *fo, int have_draft, fz_cfg *c) {
    memset(c, 0, sizeof *c);
    static const int bss[] = {8, 16};
    c->block_size = bss[rint_(s, 0, 1)];
    static const int mbs[] = {16, 24, 32, 48, 64, 96};
    c->max_batched = mbs[rint_(s, 0, 5)];
    if (c->max_batched < c->block_size) c->max_batched = c->block_size;
    c->max_seqs = rint_(s, 2, 4);
    static const int ivs[] = {8, 16, 32, 48, 64, 96, 128};
    c->interval = ivs[rint_(s, 0, 6)];
    c->ckpt_slots = rint_(s, 1, 5);
    c->extra_pages = rint_(s, 0, 12);
    int t = rint_(s, 0, 9);
    c->ram = t >= 2 && t != 4 && t != 5;
    c->disk = t == 4 || t == 5 || t >= 7;
    c->remote = fo->redis && (t == 5 || t == 9);
    c->ram_pages = (size_t)rint_(s, 2, 48);
    c->disk_pages = chance(s, 50) ? 0 : (size_t)rint_(s, 8, 64);
    c->hash_bits = chance(s, 25) ? rint_(s, 2, 8) : 0;
    int sp = rint_(s, 0, 9);
    c->spec = sp < 6 ? DS_SPEC_NONE : sp < 8 || !have_draft ? DS_SPEC_NGRAM : DS_SPEC_DSPARK;
    c->k = rint_(s, 2, 4);
    /* drawn from a copy of the stream, so that the draws after it (and every seed's other
     * choices) are what they were before the dtype was drawn */
    uint64_t s2 = *s ^ 0x6b762d6474797065ull;
    c->kv_dtype = fo->kv_dtype >= 0 ? fo->kv_dtype : (int)(rnd(&s2) % 3);
}

/* The prompt cut spacing of an engine (setup.c's: the rung spacing snapped to a page, capped by
 * the step budget). */
static int cut_of(int block, int interval, int batched) {
    return DS_MIN(batched, DS_MAX(block, interval / block * block));
}

/* Do the seed's producer and consumer cut prompts alike (so that no transfer may be refused)? */
static int pd_alike(const fz_cfg *c) {
    return c->pd_block == c->block_size && cut_of(c->pd_block, c->pd_interval, c->pd_batched) ==
                                               cut_of(c->block_size, c->interval, c->max_batched);
}

/* P/D's draws, from a stream of their own (a seed's configuration and workload stay what they
 * were before P/D existed: saved cases replay as they did). */
static void draw_pd(uint64_t seed, const fz_opts *fo, fz_work *w) {
    uint64_t s = seed * 0xd1b54a32d192ed03ull + 7;
    fz_cfg *c = &w->cfg;
    c->pd = fo->pd > 0 && chance(&s, fo->pd);
    c->pd_block = c->block_size, c->pd_interval = c->interval;
    if (c->pd && chance(&s, 20)) { /* a producer laid out otherwise: its transfers are refused */
        if (chance(&s, 50))
            c->pd_block = c->block_size == 8 ? 16 : 8;
        else
            c->pd_interval = c->interval == 64 ? 32 : 64;
    }
    /* a producer's step budget of its own (prefill servers run larger ones): its transfers
     * pair as long as the prompt cuts agree (pd_alike) */
    static const int mbs[] = {16, 32, 64, 128, 256};
    c->pd_batched = c->max_batched;
    if (c->pd && chance(&s, 30)) c->pd_batched = DS_MAX(mbs[rint_(&s, 0, 4)], c->pd_block);
    for (int i = 0; i < w->n; i++) w->r[i].pd = c->pd && w->r[i].base < 0 && chance(&s, 60);
}

/* Grammars of constrained requests: closed ones (their end forces eos early) and open ones
 * (they run to max_tokens), over ids the tiny models' tokenizer has. */
static const char *const k_grammars[] = {
    "start: /[a-c]{3,9}/ \" \" /[0-9]{1,4}/",
    "start: \"{\" /[a-z]{1,8}/ \":\" /[0-9]{1,3}/ \"}\"",
    "start: item (\" \" item)*\nitem: /[a-z]+/",
    "start: (/[0-9]/ | \",\")+",
};

/* Constrained decoding's draws, from a stream of their own (as draw_pd's). */
static void draw_grammar(uint64_t seed, const fz_opts *fo, fz_work *w) {
    uint64_t s = seed * 0x8cb92ba72f3d8dd7ull + 11;
    int any = 0;
    for (int i = 0; i < w->n; i++) {
        fz_req *q = &w->r[i];
        q->grammar = NULL;
        if (fo->grammar > 0 && chance(&s, fo->grammar)) {
            q->grammar = k_grammars[rint_(&s, 0, (int)DS_ARRAY_LEN(k_grammars) - 1)];
            any = 1;
        }
        q->p.grammar = (char *)q->grammar; /* (read only: the request's for its lifetime) */
    }
    const int beside = chance(&s, 50);
    w->cfg.async_masks = any && beside && fo->tp * fo->pp == 1; /* (a job makes them before) */
}

/* Preemption's draws, from a stream of their own (as draw_pd's). In a job the cold run's forced
 * preemptions are decided on the head and travel in its step plan. With P/D too: a preempted
 * consumer's sequence recomputes through its tiers, where the installed transfer is. */
static void draw_preempt(uint64_t seed, const fz_opts *fo, fz_work *w) {
    uint64_t s = seed * 0xa0761d6478bd642full + 13;
    w->cfg.preempt = fo->preempt > 0 && chance(&s, fo->preempt);
    w->cfg.preempt_pages = rint_(&s, 0, 3);
    for (int i = 0; i < w->n; i++) {
        fz_req *q = &w->r[i];
        memset(q->n_pre, 0, sizeof q->n_pre);
        q->pre_overflow = 0;
    }
}

/* Restarts' draws, from a stream of their own. Not with P/D (a consumer's pulls are made into the
 * engine that takes the request). */
static void draw_restart(uint64_t seed, const fz_opts *fo, fz_work *w) {
    uint64_t s = seed * 0x8bb84b93962eacc9ull + 17;
    w->cfg.restart_at =
        fo->restart > 0 && !w->cfg.pd && chance(&s, fo->restart) ? rint_(&s, 1, w->n - 1) : 0;
}

/* The cached run's hook: a preemption of (request, choice) after n tokens generated. */
static void on_preempted(void *ctx, int64_t id, int c, int n) {
    fz_work *w = ctx;
    for (int i = w->first; i < w->n_limit; i++) {
        fz_req *q = &w->r[i];
        if (!q->submitted || q->id != id || c < 0 || c >= MAX_N) continue;
        int k = q->n_pre[c];
        if (k > 0 && q->pre_at[c][k - 1] == n) {
            q->pre_cnt[c][k - 1]++;
        } else if (k < MAX_PRE) {
            q->pre_at[c][k] = n, q->pre_cnt[c][k] = 1, q->n_pre[c]++;
        } else {
            q->pre_overflow = 1;
        }
        return;
    }
}

/* The cold run's hook: preempt (request, choice) where the cached run did, in order. */
static int on_force(void *ctx, int64_t id, int c, int n) {
    fz_work *w = ctx;
    fz_req *q = w->cur;
    if (!q || q->id != id || c < 0 || c >= MAX_N) return 0;
    const int k = q->pre_next[c];
    if (k >= q->n_pre[c] || q->pre_at[c][k] != n) return 0;
    if (++q->pre_used[c] == q->pre_cnt[c][k]) q->pre_next[c]++, q->pre_used[c] = 0;
    return 1;
}

/* A prefix length near a boundary the cache cares about. */
static int near_boundary(uint64_t *s, const fz_cfg *c, int max) {
    int chunk =
        DS_MIN(c->max_batched, DS_MAX(c->block_size, c->interval / c->block_size * c->block_size));
    int units[3] = {c->block_size, chunk, c->interval};
    int u = units[rint_(s, 0, 2)];
    int m = rint_(s, 1, DS_MAX(1, max / u));
    int L = m * u + rint_(s, -2, 2);
    return DS_MAX(1, DS_MIN(max, L));
}

static void rand_tokens(uint64_t *s, int32_t *t, int n) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)(rnd(s) % VOCAB_USE);
}

static void draw_work(uint64_t *s, fz_work *w) {
    int32_t fam[3][MAX_PLEN];
    int n_fam = rint_(s, 1, 3);
    for (int f = 0; f < n_fam; f++) rand_tokens(s, fam[f], MAX_PLEN);
    w->n = rint_(s, 6, MAX_REQS);
    for (int i = 0; i < w->n; i++) {
        fz_req *q = &w->r[i];
        memset(q, 0, sizeof *q);
        q->base = -1;
        ds_request_params_default(&q->p);
        int kind = rint_(s, 0, 9);
        int prev = i ? rint_(s, 0, i - 1) : -1;
        if (prev >= 0 && kind == 0 && w->r[prev].base < 0) { /* an exact repeat */
            q->n_prompt = w->r[prev].n_prompt;
            memcpy(q->prompt, w->r[prev].prompt, (size_t)q->n_prompt * 4);
        } else if (prev >= 0 && kind == 1 && w->r[prev].base < 0 &&
                   w->r[prev].n_prompt < MAX_PLEN - 40) { /* an extension */
            q->n_prompt = w->r[prev].n_prompt;
            memcpy(q->prompt, w->r[prev].prompt, (size_t)q->n_prompt * 4);
            int add = rint_(s, 1, 40);
            rand_tokens(s, q->prompt + q->n_prompt, add);
            q->n_prompt += add;
        } else if (prev >= 0 && kind == 2 && w->r[prev].base < 0 && w->r[prev].p.n == 1 &&
                   w->r[prev].n_prompt < MAX_PLEN - 40) { /* multi-turn: after prev's answer */
            q->base = prev;
            q->n_extra = rint_(s, 1, 24);
            rand_tokens(s, q->extra, q->n_extra);
        } else { /* a family prefix and a fresh tail */
            int L = near_boundary(s, &w->cfg, MAX_PLEN - 40);
            memcpy(q->prompt, fam[rint_(s, 0, n_fam - 1)], (size_t)L * 4);
            int add = rint_(s, 0, 30);
            rand_tokens(s, q->prompt + L, add);
            q->n_prompt = L + add;
        }
        q->p.max_tokens = rint_(s, 1, MAX_GEN);
        q->p.ignore_eos = 1;
        if (chance(s, 70)) {
            q->p.sample.temperature = 0.0f;
        } else {
            q->p.sample.temperature = 0.6f + 0.1f * (float)rint_(s, 0, 6);
            q->p.sample.top_p = chance(s, 50) ? 0.9f : 1.0f;
            q->p.has_seed = 1;
            q->p.seed = rnd(s);
        }
        int lp = rint_(s, 0, 2);
        q->p.logprobs = lp == 0 ? -1 : lp == 1 ? 0 : MAX_TOP;
        q->p.n = chance(s, 10) ? 2 : 1;
        q->at = chance(s, 40) ? 0 : rint_(s, 1, 8);
        int plen = q->base >= 0 ? w->r[q->base].max_len + q->n_extra : q->n_prompt;
        q->max_len = plen + q->p.max_tokens;
        q->abort_in = chance(s, 12) ? rint_(s, 0, 15) : -1;
    }
}

/* ---- driving an engine ------------------------------------------------------------------------
 */

static void on_event(void *user, const ds_token_event *ev) {
    fz_req *q = user;
    fz_out *o = &q->out[ev->index];
    if (ev->token >= 0 && o->n < MAX_GEN) {
        int i = o->n++;
        o->tok[i] = ev->token;
        memcpy(&o->lp[i], &ev->logprob, 4);
        o->n_top[i] = DS_MIN(ev->n_top, MAX_TOP);
        for (int j = 0; j < o->n_top[i]; j++) {
            o->top_id[i][j] = ev->top_ids[j];
            memcpy(&o->top_lp[i][j], &ev->top_logprobs[j], 4);
        }
    }
    if (ev->finish != DS_FINISH_NONE) {
        o->finish = ev->finish;
        if (++q->n_done == q->p.n) q->done = 1;
    }
}

/* The prompt of a multi-turn request, from its base's prompt and first answer. */
static void build_prompt(fz_work *w, fz_req *q) {
    if (q->base < 0) return;
    const fz_req *b = &w->r[q->base];
    q->n_prompt = 0;
    memcpy(q->prompt, b->prompt, (size_t)b->n_prompt * 4);
    q->n_prompt = b->n_prompt;
    memcpy(q->prompt + q->n_prompt, b->out[0].tok, (size_t)b->out[0].n * 4);
    q->n_prompt += b->out[0].n;
    memcpy(q->prompt + q->n_prompt, q->extra, (size_t)q->n_extra * 4);
    q->n_prompt += q->n_extra;
}

static void submit(fz_work *w, fz_req *q, uint64_t step) {
    for (int c = 0; c < MAX_N; c++) memset(&q->out[c], 0, sizeof q->out[c]);
    q->n_done = q->done = q->aborted_sent = 0;
    ds_request_spec spec = {q->prompt, q->n_prompt, q->p, on_event, q, 0, q->imp};
    q->imp = NULL; /* submit takes it, also on failure */
    int why;
    ds_err err = {{0}};
    q->id = ds_engine_submit(w->e, &spec, &why, &err);
    if (q->id < 0) {
        fprintf(stdout, "cache_fuzz: submit failed: %s\n", err.msg);
        exit(3); /* a tester bug: the workload is always valid */
    }
    q->submitted = 1;
    q->submit_step = step;
    w->outstanding++;
}

/* The engine has reported a stall itself (DS_STALL_S without a planned step, engine.h); it then
 * steps once a millisecond, too slowly for STALL_STEPS to come soon. */
static int engine_stalled(ds_engine *e) {
    ds_engine_stats st;
    ds_engine_get_stats(e, &st);
    return st.stalls_total > 0;
}

/* The step hook: arrivals keyed to steps, aborts, and multi-turn follow-ups once their base is
 * done. An idle engine gets the next arrival at once (time skips ahead). */
static void hook(void *ctx, uint64_t step) {
    fz_work *w = ctx;
    if (w->stalled) return;
    uint64_t progress = 0;
    for (int i = 0; i < w->n; i++) { /* completions seen since the last step */
        fz_req *q = &w->r[i];
        if (q->submitted && q->done && q->submitted != 2) {
            q->submitted = 2;
            w->outstanding--;
        }
        progress += (uint64_t)q->n_done;
        for (int c = 0; c < q->p.n && c < MAX_N; c++) progress += (uint64_t)q->out[c].n;
    }
    if (progress != w->progress || w->outstanding == 0) {
        w->progress = progress;
        w->progress_step = step;
        w->progress_t = ds_now();
    } else if ((step - w->progress_step > STALL_STEPS && ds_now() - w->progress_t > STALL_S) ||
               (step - w->progress_step > 1000 && engine_stalled(w->e))) {
        /* the engine is stopped (aborting what is left) and the seed fails */
        pthread_mutex_lock(&w->mu);
        w->stalled = 1;
        w->finished_all = 1;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        return;
    }
    if (w->alone) {
        if (w->outstanding == 0) {
            /* (one the cached run never submitted, as when it stalled, has no prompt) */
            while (w->next < w->n_limit && w->r[w->next].n_prompt == 0) w->next++;
            if (w->next < w->n_limit) {
                w->cur = &w->r[w->next++];
                submit(w, w->cur, step);
            }
        }
    } else {
        for (int i = 0; i < w->n; i++) {
            fz_req *q = &w->r[i];
            if (q->submitted == 1 && !q->done && q->abort_in >= 0 && !q->aborted_sent &&
                step >= q->submit_step + (uint64_t)q->abort_in) {
                ds_engine_abort(w->e, q->id);
                q->aborted_sent = 1;
            }
        }
        while (w->next < w->n_limit) {
            fz_req *q = &w->r[w->next];
            if (q->base >= 0 && !w->r[q->base].done) {
                if (w->outstanding > 0) break; /* waits for its base's answer */
            }
            if (w->outstanding > 0 && step < w->last_arr + (uint64_t)q->at) break;
            build_prompt(w, q);
            submit(w, q, step);
            w->last_arr = step;
            w->next++;
        }
    }
    if (w->next >= w->n_limit && w->outstanding == 0) {
        pthread_mutex_lock(&w->mu);
        w->finished_all = 1;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
}

typedef struct fz_counts {
    uint64_t requests, compared, aborted, hit_tokens, query_tokens, forks, ckpt_evicted,
        pages_evicted, loads_ram, loads_disk, loads_remote, stores, collisions, preemptions,
        verifies, tokens;
    uint64_t pd_seeds, pd_pulls, pd_refused;  /* P/D: seeds, transfers installed, refused */
    uint64_t constrained, async_seeds;        /* choices under a grammar; seeds with masks beside */
    uint64_t preempt_seeds, preempt_replayed; /* --preempt: seeds, the cached runs' preemptions */
    uint64_t restart_seeds, restart_loads;    /* --restart: seeds, disk and Redis loads after one */
    uint64_t dtype_seeds[3];                  /* seeds of each latent cache dtype (DS_KV_*) */
} fz_counts;

/* Pages the max_seqs largest sequences of the workload need at their longest. */
static int pages_needed(const fz_work *w) {
    int need[MAX_REQS * MAX_N], n = 0, bs = w->cfg.block_size;
    for (int i = 0; i < w->n; i++)
        for (int c = 0; c < w->r[i].p.n; c++) need[n++] = (w->r[i].max_len + bs - 1) / bs + 1;
    int total = 0;
    for (int k = 0; k < w->cfg.max_seqs && k < n; k++) { /* the largest remaining, k times */
        int best = 0;
        for (int j = 1; j < n; j++)
            if (need[j] > need[best]) best = j;
        total += need[best];
        need[best] = 0;
    }
    return total;
}

static void engine_opts(const fz_opts *fo, const fz_cfg *c, int cached, ds_comm *comm,
                        const char *disk_dir, size_t slot_bytes, size_t page_bytes, int need_pages,
                        ds_engine_opts *o) {
    ds_engine_opts_default(o);
    o->model_dir = fo->model;
    o->device = fo->device;
    o->batch_invariant = fo->batch_invariant;
    o->quantization = fo->quantization;
    o->kv_dtype = c->kv_dtype;
    o->block_size = c->block_size;
    o->max_num_batched_tokens = c->max_batched;
    o->max_model_len = MODEL_LEN;
    o->comm = comm;
    o->pp_layer_counts = comm && comm->size > 1 ? fo->counts : NULL;
    o->speculative_method = c->spec;
    o->num_speculative_tokens = c->k;
    o->seed = 12345;
    /* the prompt cut spacing comes from it: the same for the cold run */
    o->state_checkpoint_interval_tokens = c->interval;
    o->test.async_masks = cached && c->async_masks;
    if (!cached) {        /* the cold reference: one request at a time, room for everything */
        if (c->preempt) { /* (speculation leaves outputs as they are: one token a step passes
                           * every preemption point the cached run had) */
            o->speculative_method = DS_SPEC_NONE;
            o->num_speculative_tokens = 0;
        }
        o->max_num_seqs = 2;
        o->enable_prefix_caching = 0;
        o->kv_cache_memory =
            2 * slot_bytes + (size_t)(2 * MODEL_LEN / c->block_size + 8) * page_bytes;
        return;
    }
    o->max_num_seqs = c->max_seqs;
    /* never preempt, and little more: the max_seqs largest sequences of the workload at their
     * longest fit (so a running set always does); the few pages beyond hold the idle cached
     * prefixes the cache must evict to admit anything */
    size_t pages = (size_t)need_pages + (size_t)c->extra_pages;
    /* and at least one sequence of MODEL_LEN (a server refuses a max_model_len its cache cannot
     * hold: a short workload of few sequences would otherwise draw a config that never starts) */
    pages = DS_MAX(pages, (size_t)((MODEL_LEN + c->block_size - 1) / c->block_size));
    if (c->preempt) /* one longest sequence and a few pages: concurrent ones preempt each other
                     * (a page count, not bytes: under -pp each stage's pages are smaller) */
        o->test.max_pages = (MODEL_LEN + c->block_size - 1) / c->block_size + c->preempt_pages;
    o->kv_cache_memory = (size_t)c->max_seqs * slot_bytes + pages * page_bytes;
    o->enable_prefix_caching = 1;
    o->state_checkpoint_memory = (size_t)c->ckpt_slots * slot_bytes;
    o->test.prefix_hash_bits = c->hash_bits;
    if (c->ram) o->kv_offload_ram_bytes = c->ram_pages * (page_bytes + 4096) + slot_bytes;
    if (c->disk) {
        o->kv_offload_disk_dir = disk_dir;
        o->kv_offload_disk_bytes = c->disk_pages * (page_bytes + 4096);
    }
    if (c->remote) o->kv_offload_remote = fo->redis;
}

static int g_verbose; /* --verbose */

/* The transfer id of request i's prompt (unique in the run: the seed is in it). */
static uint64_t pd_id(const fz_work *w, int i) {
    return (w->seed << 6 | (uint64_t)i) | 1ull << 63;
}

typedef struct fz_prod { /* the producer's requests in flight */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int left;
} fz_prod;

static void prod_event(void *user, const ds_token_event *ev) {
    fz_prod *p = user;
    if (ev->finish == DS_FINISH_NONE) return;
    pthread_mutex_lock(&p->mu);
    p->left--;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* The P/D producer of a seed: an engine with the seed's configuration but its own block size and
 * rung spacing, no offload tier and ample pools, that prefills every P/D prompt of the workload
 * as vllm-router's first request (one greedy token, a transfer filed for the consumer), all at
 * once. Returns it running, holding the transfers (*port: where to pull them). */
static int run_producer(const fz_opts *fo, fz_work *w, size_t slot_bytes, size_t token_bytes,
                        ds_engine **out, int *port, ds_err *err) {
    fz_cfg pc = w->cfg;
    pc.block_size = pc.pd_block, pc.interval = pc.pd_interval, pc.max_batched = pc.pd_batched;
    pc.ram = pc.disk = pc.remote = 0, pc.hash_bits = 0;
    ds_engine_opts o;
    const size_t page = token_bytes * (size_t)pc.block_size;
    engine_opts(fo, &pc, 1, NULL, NULL, slot_bytes, page,
                pc.max_seqs * (MODEL_LEN / pc.block_size + 2), &o);
    o.kv_role = DS_KV_PRODUCER;
    o.kv_port = 0;
    ds_engine *e;
    if (ds_engine_create(&o, &e, err)) return DS_ERR;
    if (ds_engine_start(e, err)) {
        ds_engine_free(e);
        return DS_ERR;
    }
    fz_prod p = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    for (int i = 0; i < w->n; i++) {
        fz_req *q = &w->r[i];
        if (!q->pd) continue;
        ds_request_params rp;
        ds_request_params_default(&rp);
        rp.max_tokens = 1, rp.ignore_eos = 1, rp.sample.temperature = 0.0f;
        ds_request_spec spec = {q->prompt, q->n_prompt, rp, prod_event, &p, pd_id(w, i), NULL};
        int why;
        pthread_mutex_lock(&p.mu);
        p.left++;
        pthread_mutex_unlock(&p.mu);
        if (ds_engine_submit(e, &spec, &why, err) < 0) {
            ds_engine_stop(e, 5.0);
            ds_engine_free(e);
            return DS_ERR;
        }
    }
    pthread_mutex_lock(&p.mu);
    while (p.left > 0) pthread_cond_wait(&p.cv, &p.mu);
    pthread_mutex_unlock(&p.mu);
    *port = ds_engine_kv_port(e);
    *out = e;
    return DS_OK;
}

/* An engine's counters into the run's. */
static void add_counts(fz_counts *ct, const ds_engine_stats *s, int preempting) {
    ct->hit_tokens += s->prefix_hit_tokens;
    ct->query_tokens += s->prefix_query_tokens;
    ct->forks += s->forks;
    ct->ckpt_evicted += s->ckpt_evicted;
    ct->pages_evicted += s->prefix_pages_evicted;
    ct->loads_ram += s->offload_loads_ram;
    ct->loads_disk += s->offload_loads_disk;
    ct->loads_remote += s->offload_loads_remote;
    ct->stores += s->offload_stores;
    ct->collisions += s->prefix_collisions;
    if (preempting)
        ct->preempt_replayed += s->preemptions_total;
    else
        ct->preemptions += s->preemptions_total;
    ct->verifies += s->spec_verifies;
    ct->pd_pulls += s->kv_pulls;
    ct->pd_refused += s->kv_pull_failures;
}

/* Runs the workload on one engine, or two one after another when the seed restarts (every rank
 * calls this; the head drives). pd_port > 0: the
 * engine is a P/D consumer and pulls the transfers of the workload's P/D requests from the
 * producer there before it starts (each submitted with its pull; a refused one without). */
static int run_engine(const ds_engine_opts *o, fz_work *w, int head, int alone, fz_counts *ct,
                      int pd_port, ds_err *err) {
    ds_engine_opts oo = *o;
    w->next = 0;
    w->outstanding = 0;
    w->last_arr = 0;
    w->alone = alone;
    w->stalled = 0;
    if (head) {
        oo.test.step = hook;
        oo.test.step_ctx = w;
        if (w->cfg.preempt) {
            if (alone)
                oo.test.force_preempt = on_force;
            else
                oo.test.preempted = on_preempted;
            oo.test.preempt_ctx = w;
        }
    }
    /* (every rank draws the same restart: each makes its engine anew) */
    const int engines = !alone && w->cfg.restart_at > 0 ? 2 : 1;
    for (int k = 0; k < engines && !w->stalled; k++) {
        w->first = k ? w->cfg.restart_at : 0;
        w->n_limit = k + 1 < engines ? w->cfg.restart_at : w->n;
        w->finished_all = 0;
        w->progress = w->progress_step = 0;
        w->progress_t = ds_now();
        if (ds_engine_create(&oo, &w->e, err)) return DS_ERR;
        for (int i = 0; pd_port > 0 && i < w->n; i++) {
            fz_req *q = &w->r[i];
            ds_err perr = {{0}};
            /* (a refusal is counted by the engine; the request then recomputes) */
            if (q->pd && ds_engine_kv_pull(w->e, "127.0.0.1", pd_port, pd_id(w, i), q->prompt,
                                           q->n_prompt, &q->imp, &perr)) {
                if (!w->pd_refused++) snprintf(w->pd_why, sizeof w->pd_why, "%s", perr.msg);
                if (g_verbose) printf("  request %d: P/D pull refused: %s\n", i, perr.msg);
            }
        }
        if (ds_engine_start(w->e, err)) {
            ds_engine_free(w->e);
            return DS_ERR;
        }
        if (head) {
            /* the loop's first iteration calls the hook before it waits for work */
            pthread_mutex_lock(&w->mu);
            while (!w->finished_all) pthread_cond_wait(&w->cv, &w->mu);
            pthread_mutex_unlock(&w->mu);
            ds_engine_stats s;
            ds_engine_get_stats(w->e, &s);
            if (ct) add_counts(ct, &s, w->cfg.preempt);
            if (ct && k) ct->restart_loads += s.offload_loads_disk + s.offload_loads_remote;
            ds_engine_stop(w->e, w->stalled ? 0.0 : 5.0);
        } else {
            ds_engine_join(w->e);
        }
        ds_engine_free(w->e);
        w->e = NULL;
    }
    return DS_OK;
}

static int same_out(const fz_out *a, const fz_out *ref, int aborted, int lp, char *why,
                    size_t cap) {
    if (aborted ? a->n > ref->n : a->n != ref->n) {
        snprintf(why, cap, "%d tokens, the cold run %d", a->n, ref->n);
        return 0;
    }
    for (int i = 0; i < a->n; i++) {
        if (a->tok[i] != ref->tok[i]) {
            snprintf(why, cap, "token %d: %d, the cold run %d", i, a->tok[i], ref->tok[i]);
            return 0;
        }
        if (lp && a->lp[i] != ref->lp[i]) {
            float x, y;
            memcpy(&x, &a->lp[i], 4);
            memcpy(&y, &ref->lp[i], 4);
            snprintf(why, cap, "logprob of token %d: %.9g, the cold run %.9g (diff %.3g)", i, x, y,
                     (double)(x - y));
            return 0;
        }
        if (lp && (a->n_top[i] != ref->n_top[i] ||
                   memcmp(a->top_id[i], ref->top_id[i], (size_t)a->n_top[i] * 4) ||
                   memcmp(a->top_lp[i], ref->top_lp[i], (size_t)a->n_top[i] * 4))) {
            snprintf(why, cap, "top logprobs of token %d differ", i);
            return 0;
        }
    }
    if (!aborted && a->finish != ref->finish) {
        snprintf(why, cap, "finish %s, the cold run %s", ds_finish_name(a->finish),
                 ds_finish_name(ref->finish));
        return 0;
    }
    return 1;
}

static void describe_cfg(const fz_cfg *c, char *b, size_t cap) {
    int n = snprintf(b, cap,
                     "P/D consumer of a producer with block %d, rungs every %d, step budget %d; ",
                     c->pd_block, c->pd_interval, c->pd_batched);
    if (!c->pd) n = 0;
    b += n, cap -= (size_t)n;
    n = c->async_masks ? snprintf(b, cap, "grammar masks beside the forward; ") : 0;
    b += n, cap -= (size_t)n;
    n = c->restart_at ? snprintf(b, cap, "restarted once requests [0, %d) ended; ", c->restart_at)
                      : 0;
    b += n, cap -= (size_t)n;
    n = c->preempt ? snprintf(b, cap,
                              "preempting (pages: one longest sequence + %d), the cold "
                              "run replaying; ",
                              c->preempt_pages)
                   : 0;
    b += n, cap -= (size_t)n;
    snprintf(b, cap,
             "block %d, step budget %d, seqs %d, rungs every %d, %d checkpoint slots, +%d pages, "
             "tiers%s%s%s%s (ram %zu pages, disk %zu pages), hash bits %d, spec %s k %d, "
             "kv cache %s",
             c->block_size, c->max_batched, c->max_seqs, c->interval, c->ckpt_slots, c->extra_pages,
             c->ram ? " ram" : "", c->disk ? " disk" : "", c->remote ? " redis" : "",
             !c->ram && !c->disk && !c->remote ? " none" : "", c->ram_pages, c->disk_pages,
             c->hash_bits,
             c->spec == DS_SPEC_NONE    ? "none"
             : c->spec == DS_SPEC_NGRAM ? "ngram"
                                        : "dspark",
             c->k, c->kv_dtype == DS_KV_F32 ? "f32" : ds_kv_dtype_names[c->kv_dtype]);
}

static void rm_tree(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) { /* leftovers in a temporary folder */
    }
}

/* One seed on every rank; the head compares. Returns 1 when it agreed, 0 on a mismatch. */
static int run_seed(const fz_opts *fo, ds_comm *comm, uint64_t seed, int have_draft,
                    size_t slot_bytes, size_t page_bytes, fz_counts *ct, ds_err *err) {
    int head = !comm || comm->rank == 0;
    static fz_work w; /* large: not on the stack */
    memset(&w.cfg, 0, sizeof w.cfg);
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    draw_cfg(&s, fo, have_draft, &w.cfg);
    draw_work(&s, &w);
    w.seed = seed;
    w.pd_refused = 0;
    draw_pd(seed, fo, &w);
    draw_grammar(seed, fo, &w);
    draw_preempt(seed, fo, &w);
    draw_restart(seed, fo, &w);
    ct->restart_seeds += w.cfg.restart_at > 0;
    ct->async_seeds += w.cfg.async_masks;
    ct->preempt_seeds += w.cfg.preempt;
    ct->dtype_seeds[w.cfg.kv_dtype]++;
    char disk[4096];
    snprintf(disk, sizeof disk, "%s/seed-%llu", fo->work_dir, (unsigned long long)seed);
    ds_engine_opts o;
    engine_opts(fo, &w.cfg, 1, comm, disk, slot_bytes, page_bytes, pages_needed(&w), &o);
    ds_engine *prod = NULL;
    int port = 0;
    if (w.cfg.pd && head) { /* (the producer is one process, on the head's) */
        if (run_producer(fo, &w, slot_bytes, page_bytes / (size_t)w.cfg.block_size, &prod, &port,
                         err))
            return -1;
        ct->pd_seeds++;
        if (g_verbose)
            printf("  P/D: producer block %d rungs every %d budget %d, consumer block %d rungs "
                   "every %d budget %d\n",
                   w.cfg.pd_block, w.cfg.pd_interval, w.cfg.pd_batched, w.cfg.block_size,
                   w.cfg.interval, w.cfg.max_batched);
    }
    if (w.cfg.pd) o.kv_role = DS_KV_CONSUMER; /* (every rank of the consumer) */
    int rc = run_engine(&o, &w, head, 0, ct, port, err);
    ds_engine_stats ps = {0};
    if (prod) { /* every transfer was pulled (or refused after its pull): none may be held */
        ds_engine_get_stats(prod, &ps);
        ds_engine_stop(prod, 5.0);
        ds_engine_free(prod);
    }
    if (rc) return -1;
    /* the cold reference, every request alone (aborted ones too: what they emitted must be a
     * prefix of what they would have) */
    static fz_work ref;
    ref = w;
    pthread_mutex_init(&ref.mu, NULL);
    pthread_cond_init(&ref.cv, NULL);
    ref.cur = NULL;
    for (int i = 0; i < ref.n; i++) {
        ref.r[i].base = -1; /* prompts as the cached run built them */
        ref.r[i].submitted = 0;
        ref.r[i].aborted_sent = 0;
        memset(ref.r[i].pre_next, 0, sizeof ref.r[i].pre_next);
        memset(ref.r[i].pre_used, 0, sizeof ref.r[i].pre_used);
    }
    engine_opts(fo, &w.cfg, 0, comm, disk, slot_bytes, page_bytes, 0, &o);
    if (run_engine(&o, &ref, head, 1, NULL, 0, err)) return -1;
    if (head) rm_tree(disk);
    if (!head) return 1;
    int ok = 1;
    /* producer and consumer cutting prompts alike (pd_alike): nothing may refuse a transfer (a
     * refusal recomputes, so the outputs cannot tell) */
    if (w.cfg.pd && w.pd_refused && pd_alike(&w.cfg)) {
        printf("MISMATCH seed %llu: %d P/D transfers refused between engines that cut prompts "
               "alike: %s\n",
               (unsigned long long)seed, w.pd_refused, w.pd_why);
        ok = 0;
    }
    if (w.stalled || ref.stalled) {
        printf("MISMATCH seed %llu: the %s run stalled (no token or end for %d steps and %.0f s "
               "with requests outstanding: a request left without its end)\n",
               (unsigned long long)seed, w.stalled ? "cached" : "cold", STALL_STEPS, STALL_S);
        ok = 0;
    }
    if (ps.kv_held) {
        printf("MISMATCH seed %llu: the P/D producer still holds %d transfers after the pulls\n",
               (unsigned long long)seed, ps.kv_held);
        ok = 0;
    }
    for (int i = 0; i < w.n; i++) {
        fz_req *q = &w.r[i];
        if (!q->submitted) continue; /* (only when the cached run stalled: reported above) */
        ct->requests++;
        for (int c = 0; c < q->p.n; c++) {
            int aborted = q->out[c].finish == DS_FINISH_ABORT;
            ct->aborted += aborted;
            ct->compared++;
            ct->constrained += q->grammar != NULL;
            ct->tokens += (uint64_t)q->out[c].n;
            char why[256];
            int same = same_out(&q->out[c], &ref.r[i].out[c], aborted, q->p.logprobs >= 0, why,
                                sizeof why);
            if (same && (q->pre_overflow || ref.r[i].pre_next[c] < q->n_pre[c])) {
                /* a preemption the cold run never reached (or more than were recorded) */
                snprintf(why, sizeof why,
                         "%d of %d preemption points replayed (the next after %d tokens)%s",
                         ref.r[i].pre_next[c], q->n_pre[c],
                         ref.r[i].pre_next[c] < q->n_pre[c] ? q->pre_at[c][ref.r[i].pre_next[c]]
                                                            : -1,
                         q->pre_overflow ? ", more than MAX_PRE recorded" : "");
                same = 0;
            }
            if (!same) {
                char cfg[512];
                describe_cfg(&w.cfg, cfg, sizeof cfg);
                printf(
                    "MISMATCH seed %llu request %d (prompt %d tokens%s%s%s, %s, n %d) choice %d: "
                    "%s\n  config: %s\n",
                    (unsigned long long)seed, i, q->n_prompt, q->base >= 0 ? ", multi-turn" : "",
                    q->pd ? ", P/D" : "", q->grammar ? ", constrained" : "",
                    q->p.sample.temperature == 0.0f ? "greedy" : "sampled", q->p.n, c, why, cfg);
                ok = 0;
            }
        }
    }
    return ok;
}

static int parse_args(int argc, char **argv, fz_opts *fo, const char **case_file) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--verbose")) {
            fo->verbose = 1;
            continue;
        }
        if (!strcmp(a, "--batch-invariant")) {
            fo->batch_invariant = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "cache_fuzz: %s needs a value (or is unknown)\n", a);
            return -1;
        }
        i++;
        if (!strcmp(a, "--model"))
            fo->model = v;
        else if (!strcmp(a, "--seeds"))
            fo->seeds = atoi(v);
        else if (!strcmp(a, "--seed0"))
            fo->seed0 = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--redis"))
            fo->redis = v;
        else if (!strcmp(a, "-tp"))
            fo->tp = atoi(v);
        else if (!strcmp(a, "-pp"))
            fo->pp = atoi(v);
        else if (!strcmp(a, "--device"))
            fo->device = !strcmp(v, "cuda") ? DS_DEVICE_CUDA : DS_DEVICE_CPU;
        else if (!strcmp(a, "--quantization"))
            fo->quantization = !strcmp(v, "ptpc_fp8") ? DS_QUANT_PTPC_FP8 : DS_QUANT_NONE;
        else if (!strcmp(a, "--kv-cache-dtype"))
            fo->kv_dtype = !strcmp(v, "mixed") ? -1 : ds_kv_dtype_from_name(v);
        else if (!strcmp(a, "--experts")) {
            if (strcmp(v, "bf16") && strcmp(v, "mxfp4")) {
                fprintf(stderr, "cache_fuzz: --experts is bf16 or mxfp4, not '%s'\n", v);
                return -1;
            }
            fo->mxfp4 = !strcmp(v, "mxfp4");
        } else if (!strcmp(a, "--save-dir"))
            fo->save_dir = v;
        else if (!strcmp(a, "--max-seconds"))
            fo->max_seconds = atof(v);
        else if (!strcmp(a, "--pd"))
            fo->pd = atoi(v);
        else if (!strcmp(a, "--grammar"))
            fo->grammar = atoi(v);
        else if (!strcmp(a, "--preempt"))
            fo->preempt = atoi(v);
        else if (!strcmp(a, "--restart"))
            fo->restart = atoi(v);
        else if (!strcmp(a, "--work-dir"))
            fo->work_dir = v;
        else if (!strcmp(a, "--case"))
            *case_file = v;
        else {
            fprintf(stderr, "cache_fuzz: unknown flag %s\n", a);
            return -1;
        }
    }
    if (fo->mxfp4 && fo->model && !fo->work_dir) { /* (ranks get both: the made model's path) */
        fprintf(stderr, "cache_fuzz: --experts mxfp4 shapes the model it makes, not --model's\n");
        return -1;
    }
    if (fo->seeds < 1 || fo->tp < 1 || fo->pp < 1) {
        fprintf(stderr, "cache_fuzz: --seeds, -tp and -pp must be positive\n");
        return -1;
    }
    if (fo->restart < 0 || fo->restart > 100 || fo->pd < 0 || fo->pd > 100 || fo->grammar < 0 ||
        fo->grammar > 100 || fo->preempt < 0 || fo->preempt > 100) {
        fprintf(stderr, "cache_fuzz: --pd, --grammar and --preempt are percentages (0 to 100)\n");
        return -1;
    }
    if (fo->pd && fo->tp > 1) {
        fprintf(stderr, "cache_fuzz: --pd is not for -tp: the producer is one process, whose sums "
                        "differ from a tensor-parallel consumer's in the last bits (-pp is)\n");
        return -1;
    }
    return 0;
}

/* A saved case: one line of arguments (seed0 / seeds / tp / pp / device / redis). */
static int read_case(const char *path, fz_opts *fo) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "cache_fuzz: cannot read case %s: %s\n", path, strerror(errno));
        return -1;
    }
    static char line[1024]; /* the options point into it for the whole run */
    int ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    if (!ok) {
        fprintf(stderr, "cache_fuzz: case %s is empty\n", path);
        return -1;
    }
    char *av[32];
    int ac = 1;
    av[0] = "cache_fuzz";
    for (char *t = strtok(line, " \t\n"); t && ac < 31; t = strtok(NULL, " \t\n")) av[ac++] = t;
    const char *dummy = NULL;
    return parse_args(ac, av, fo, &dummy);
}

int main(int argc, char **argv) {
    fz_opts fo = {0};
    fo.seeds = 100;
    fo.tp = fo.pp = 1;
    fo.device = DS_DEVICE_CPU;
    const char *case_file = NULL;
    if (parse_args(argc, argv, &fo, &case_file)) return 2;
    if (case_file && read_case(case_file, &fo)) return 2;
    g_verbose = fo.verbose;
    ds_err err = {{0}};
    char tmp_model[4200], tmp_work[4000];
    if (!fo.work_dir) {
        /* one folder for the job, made before mpirun so every rank gets the same path */
        snprintf(tmp_work, sizeof tmp_work, "%s/cache-fuzz-XXXXXX",
                 getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(tmp_work)) {
            fprintf(stderr, "cache_fuzz: cannot make a work folder: %s\n", strerror(errno));
            return 2;
        }
        fo.work_dir = tmp_work;
        if (!fo.model) {
            snprintf(tmp_model, sizeof tmp_model, "%s/tiny-k3", tmp_work);
            if (ds_init_model_ex("tiny-k3", tmp_model, 0, fo.mxfp4, &err)) {
                fprintf(stderr, "cache_fuzz: %s\n", err.msg);
                return 2;
            }
            fo.model = tmp_model;
        }
        if (fo.tp * fo.pp > 1 && !ds_comm_under_mpirun()) {
            /* the job re-runs this program with the folder and model named */
            char **av = calloc((size_t)argc + 5, sizeof *av);
            int k = 0;
            for (int i = 1; i < argc; i++) av[k++] = argv[i];
            av[k++] = "--work-dir";
            av[k++] = tmp_work;
            av[k++] = "--model";
            av[k++] = (char *)fo.model;
            /* Open MPI's own allocations are never freed: under LeakSanitizer the ranks would
             * fail on them (later ASAN_OPTIONS entries override earlier ones) */
            const char *asan = getenv("ASAN_OPTIONS");
            char abuf[1024];
            snprintf(abuf, sizeof abuf, "%s%sdetect_leaks=0", asan ? asan : "",
                     asan && *asan ? ":" : "");
            setenv("ASAN_OPTIONS", abuf, 1);
            int st = 1;
            if (ds_launch_mpirun_supervised(fo.tp * fo.pp, k, av, &st, &err)) {
                fprintf(stderr, "cache_fuzz: %s\n", err.msg);
                st = 2;
            }
            rm_tree(tmp_work);
            free(av);
            return st;
        }
    } else if (!fo.model) {
        fprintf(stderr, "cache_fuzz: --work-dir needs --model\n");
        return 2;
    }
    if (ds_pp_check_split(fo.model, fo.tp, fo.pp, NULL, fo.counts, &err)) {
        fprintf(stderr, "cache_fuzz: %s\n", err.msg);
        return 2;
    }
    if (fo.tp * fo.pp > 1 && !getenv("DS_COMM_TIMEOUT_S")) setenv("DS_COMM_TIMEOUT_S", "120", 1);
    ds_comm *comm = NULL;
    if (ds_comm_init(fo.tp, fo.pp, &comm, &err)) {
        fprintf(stderr, "cache_fuzz: %s\n", err.msg);
        return ds_comm_finish(comm, 2);
    }
    int head = comm->rank == 0;
    /* the engines' set-up lines, twice a seed, would bury the report */
    if (!fo.verbose) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) {
            fflush(stderr);
            dup2(fd, 2);
            close(fd);
        }
    }
    ds_model *m;
    ds_model_opts mo;
    ds_model_opts_default(&mo);
    if (ds_model_load(fo.model, &mo, &m, &err)) {
        printf("cache_fuzz: %s\n", err.msg);
        return ds_comm_finish(comm, 2);
    }
    size_t slot_bytes = ds_model_slot_floats(m) * sizeof(float);
    /* a token's latent bytes in a page, for each cache dtype a seed may draw */
    size_t page_bytes_per_token[3];
    const ds_config *mc = ds_model_config(m);
    for (int dt = 0; dt < 3; dt++)
        page_bytes_per_token[dt] = (size_t)ds_kv_pool_layers(m) *
                                   ds_kv_row_bytes(dt, mc->kv_lora_rank, mc->qk_rope_head_dim);
    ds_model_free(m);
    char draft[4200];
    snprintf(draft, sizeof draft, "%s/draft/config.json", fo.model);
    int have_draft = access(draft, R_OK) == 0;

    fz_counts ct = {0};
    int failed = 0, status = 0;
    double t0 = ds_now();
    int ran = 0;
    for (int i = 0; i < fo.seeds; i++) {
        /* every rank must take the same decision: the head's clock, broadcast */
        int stop = fo.max_seconds > 0 && ds_now() - t0 > fo.max_seconds;
        if (comm->size > 1 && ds_comm_bcast(comm, &stop, sizeof stop, &err)) {
            status = 2;
            break;
        }
        if (stop) break;
        ran++;
        uint64_t seed = fo.seed0 + (uint64_t)i;
        uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
        fz_cfg c;
        draw_cfg(&s, &fo, have_draft, &c); /* the block size and dtype, for the page's bytes */
        int r = run_seed(&fo, comm, seed, have_draft, slot_bytes,
                         page_bytes_per_token[c.kv_dtype] * (size_t)c.block_size, &ct, &err);
        if (r < 0) {
            if (head) printf("cache_fuzz: seed %llu: %s\n", (unsigned long long)seed, err.msg);
            status = 2;
            break;
        }
        if (head && !r) {
            failed++;
            if (fo.save_dir) {
                char path[4300];
                mkdir(fo.save_dir, 0755);
                snprintf(path, sizeof path, "%s/seed-%llu%s%s.case", fo.save_dir,
                         (unsigned long long)seed, fo.tp * fo.pp > 1 ? "-dist" : "",
                         fo.device == DS_DEVICE_CUDA ? "-cuda" : "");
                FILE *f = fopen(path, "w");
                if (f) {
                    fprintf(f,
                            "--seed0 %llu --seeds 1 -tp %d -pp %d --pd %d --grammar %d "
                            "--preempt %d --restart %d --device %s%s%s%s%s%s\n",
                            (unsigned long long)seed, fo.tp, fo.pp, fo.pd, fo.grammar, fo.preempt,
                            fo.restart, fo.device == DS_DEVICE_CUDA ? "cuda" : "cpu",
                            fo.batch_invariant ? " --batch-invariant" : "",
                            fo.quantization ? " --quantization ptpc_fp8" : "",
                            c.kv_dtype ? " --kv-cache-dtype " : "",
                            c.kv_dtype ? ds_kv_dtype_names[c.kv_dtype] : "",
                            fo.redis && c.remote ? " --redis redis://127.0.0.1:6379" : "");
                    fclose(f);
                    printf("  saved as %s\n", path);
                }
            }
        }
        if (head && fo.verbose)
            printf("seed %llu: %s\n", (unsigned long long)seed, r ? "ok" : "MISMATCH");
    }
    if (head && status == 0) {
        printf("cache_fuzz: %d seeds from %llu (-tp %d -pp %d, %s) in %.1f s: %llu requests, "
               "%llu choices compared (%llu aborted), %llu tokens; prefix hits %llu of %llu "
               "prompt tokens, %llu forks, %llu checkpoint and %llu page evictions, tier loads "
               "ram %llu disk %llu redis %llu (%llu stores), %llu hash collisions, %llu verifies, "
               "%llu preemptions\n",
               ran, (unsigned long long)fo.seed0, fo.tp, fo.pp,
               fo.device == DS_DEVICE_CUDA ? "cuda" : "cpu", ds_now() - t0,
               (unsigned long long)ct.requests, (unsigned long long)ct.compared,
               (unsigned long long)ct.aborted, (unsigned long long)ct.tokens,
               (unsigned long long)ct.hit_tokens, (unsigned long long)ct.query_tokens,
               (unsigned long long)ct.forks, (unsigned long long)ct.ckpt_evicted,
               (unsigned long long)ct.pages_evicted, (unsigned long long)ct.loads_ram,
               (unsigned long long)ct.loads_disk, (unsigned long long)ct.loads_remote,
               (unsigned long long)ct.stores, (unsigned long long)ct.collisions,
               (unsigned long long)ct.verifies, (unsigned long long)ct.preemptions);
        if (fo.pd)
            printf("cache_fuzz: P/D in %llu seeds: %llu transfers pulled and installed, %llu "
                   "refused (recomputed)\n",
                   (unsigned long long)ct.pd_seeds, (unsigned long long)ct.pd_pulls,
                   (unsigned long long)ct.pd_refused);
        if (fo.kv_dtype < 0) {
            printf("cache_fuzz: latent cache f32 in %llu seeds, fp8 in %llu, bf16 in %llu\n",
                   (unsigned long long)ct.dtype_seeds[DS_KV_F32],
                   (unsigned long long)ct.dtype_seeds[DS_KV_FP8],
                   (unsigned long long)ct.dtype_seeds[DS_KV_BF16]);
            /* (one seed in three of each: with 24 or more, a dtype left out is a bug) */
            if (ran >= 24 && (!ct.dtype_seeds[DS_KV_FP8] || !ct.dtype_seeds[DS_KV_BF16])) {
                printf("cache_fuzz: the run drew no FP8 or no BF16 seed\n");
                status = 1;
            }
        }
        if (ct.preemptions) {
            printf("cache_fuzz: a sequence was preempted: the pools are sized so that none is\n");
            status = 1;
        }
        if (fo.preempt)
            printf("cache_fuzz: %llu seeds short of pages, %llu preemptions replayed by the cold "
                   "runs\n",
                   (unsigned long long)ct.preempt_seeds, (unsigned long long)ct.preempt_replayed);
        /* (a quarter to a half of the seeds short of pages preempt, the rest running light
         * workloads; sixteen in a row preempted nothing once, from 55,620, so make test's
         * preemption campaign runs 32) */
        if (ct.preempt_seeds >= 12 && !ct.preempt_replayed) {
            printf("cache_fuzz: the run preempted nothing\n");
            status = 1;
        }
        if (fo.restart)
            printf("cache_fuzz: %llu seeds restarted halfway, %llu disk and Redis loads by the "
                   "engines after a restart\n",
                   (unsigned long long)ct.restart_seeds, (unsigned long long)ct.restart_loads);
        if (ct.restart_seeds >= 8 && !ct.restart_loads) {
            printf("cache_fuzz: no engine read what the one before it left in the tiers\n");
            status = 1;
        }
        if (fo.grammar)
            printf("cache_fuzz: %llu choices constrained by a grammar, %llu seeds with the masks "
                   "beside the forward\n",
                   (unsigned long long)ct.constrained, (unsigned long long)ct.async_seeds);
        if (ran >= 8 && fo.grammar >= 10 &&
            (!ct.constrained || (fo.tp * fo.pp == 1 && !ct.async_seeds))) {
            printf("cache_fuzz: the run constrained no choice, or made no mask beside a forward\n");
            status = 1;
        }
        if (ran >= 8 && fo.pd >= 25 && !ct.pd_pulls) {
            printf("cache_fuzz: the run installed no P/D transfer\n");
            status = 1;
        }
        /* a run long enough to mean something must have exercised the cache */
        if (ran >= 8 &&
            (!ct.hit_tokens || !ct.forks || !ct.ckpt_evicted || !(ct.loads_ram + ct.loads_disk) ||
             (fo.tp * fo.pp == 1 && !ct.pages_evicted))) {
            printf("cache_fuzz: the run did not exercise hits, forks, evictions and tier loads\n");
            status = 1;
        }
        printf("%d passed, %d failed\n", ran - failed, failed);
        if (failed) status = 1;
    }
    return ds_comm_finish(comm, status);
}
