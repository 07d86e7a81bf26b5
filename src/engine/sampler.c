/* sampler.c — penalties, stop masking, logprobs and the draw; see sampler.h for the contract.
 *
 * The order of a candidate is (logit descending, id ascending): a strict total order, so top-k,
 * top-p and greedy never depend on how ties happen to fall in memory. */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>

/* Below this temperature vLLM samples greedily; dividing by it would only amplify rounding. */
#define GREEDY_TEMPERATURE 1e-5f

void ds_sample_params_default(ds_sample_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
}

void ds_sampling_default(ds_sampling *s) {
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->top_k = 0;
    s->min_p = 0.0f;
}

/* ---- token counts ------------------------------------------------------------------------------
 */

static uint32_t hash_id(int32_t id) {
    uint32_t h = (uint32_t)id * 2654435761u; /* Fibonacci hashing; the shift folds high bits in */
    return h ^ (h >> 16);
}

/* The slot holding id, or the empty slot where it would go. The table is never full (n <= cap/2),
 * so the probe ends. */
static ds_token_count *find_slot(ds_token_count *slots, int cap, int32_t id) {
    uint32_t mask = (uint32_t)cap - 1, i = hash_id(id) & mask;
    while (slots[i].id != id && slots[i].id != -1) i = (i + 1) & mask;
    return &slots[i];
}

static int counts_grow(ds_token_counts *c, ds_err *err) {
    int cap = c->cap ? c->cap * 2 : 64;
    ds_token_count *slots = ds_malloc((size_t)cap * sizeof *slots, err);
    if (!slots) return DS_ERR;
    memset(slots, 0xff, (size_t)cap * sizeof *slots); /* id -1: empty */
    for (int i = 0; i < c->cap; i++)
        if (c->slots[i].id >= 0) *find_slot(slots, cap, c->slots[i].id) = c->slots[i];
    free(c->slots);
    c->slots = slots;
    c->cap = cap;
    return DS_OK;
}

int ds_token_counts_add(ds_token_counts *c, int32_t id, ds_err *err) {
    if (id < 0) return ds_errf(err, "token counts: id %d is negative", (int)id);
    if (2 * (c->n + 1) > c->cap && counts_grow(c, err)) return DS_ERR;
    ds_token_count *s = find_slot(c->slots, c->cap, id);
    if (s->id == -1) {
        s->id = id;
        s->count = 0;
        c->n++;
    }
    s->count++;
    return DS_OK;
}

int ds_token_counts_get(const ds_token_counts *c, int32_t id) {
    if (!c->cap || id < 0) return 0;
    const ds_token_count *s = find_slot(c->slots, c->cap, id);
    return s->id == id ? s->count : 0;
}

void ds_token_counts_clear(ds_token_counts *c) {
    if (c->cap) memset(c->slots, 0xff, (size_t)c->cap * sizeof *c->slots);
    c->n = 0;
}

void ds_token_counts_free(ds_token_counts *c) {
    free(c->slots);
    memset(c, 0, sizeof *c);
}

/* ---- scratch -----------------------------------------------------------------------------------
 */

int ds_sample_scratch_init(ds_sample_scratch *s, int cap, ds_err *err) {
    memset(s, 0, sizeof *s);
    s->w = ds_malloc((size_t)cap * sizeof(float), err);
    s->idx = s->w ? ds_malloc((size_t)cap * sizeof(int32_t), err) : NULL;
    s->raw = s->idx ? ds_malloc((size_t)cap * sizeof(float), err) : NULL;
    if (!s->raw) {
        ds_sample_scratch_free(s);
        return DS_ERR;
    }
    s->cap = cap;
    return DS_OK;
}

void ds_sample_scratch_free(ds_sample_scratch *s) {
    free(s->w);
    free(s->idx);
    free(s->raw);
    memset(s, 0, sizeof *s);
}

/* ---- ordering and selection --------------------------------------------------------------------
 */

/* 1 if id a comes before id b: larger logit first, then smaller id. key holds no NaN. */
static inline int before(int32_t a, int32_t b, const float *key) {
    return key[a] > key[b] || (key[a] == key[b] && a < b);
}

#define SWAP_IDX(i, j)                                                                             \
    do {                                                                                           \
        int32_t t_ = idx[i];                                                                       \
        idx[i] = idx[j];                                                                           \
        idx[j] = t_;                                                                               \
    } while (0)

static void sort_small(int32_t *idx, int n, const float *key) {
    for (int i = 1; i < n; i++) {
        int32_t v = idx[i];
        int j = i;
        for (; j > 0 && before(v, idx[j - 1], key); j--) idx[j] = idx[j - 1];
        idx[j] = v;
    }
}

/* Partitions idx[lo..hi) (hi - lo >= 3) around a median-of-three pivot and returns its final
 * position q: idx[lo..q) come before it, idx(q..hi) after it. */
static int partition(int32_t *idx, int lo, int hi, const float *key) {
    int mid = lo + (hi - lo) / 2, last = hi - 1;
    if (before(idx[mid], idx[lo], key)) SWAP_IDX(mid, lo);
    if (before(idx[last], idx[lo], key)) SWAP_IDX(last, lo);
    if (before(idx[last], idx[mid], key)) SWAP_IDX(last, mid);
    SWAP_IDX(mid, last); /* the median becomes the pivot */
    int32_t pivot = idx[last];
    int s = lo;
    for (int i = lo; i < last; i++)
        if (before(idx[i], pivot, key)) {
            SWAP_IDX(s, i);
            s++;
        }
    SWAP_IDX(s, last);
    return s;
}

/* Quickselect over idx[0..n): rearranges it so that idx[0..m) are the first m ids in `before`
 * order (in no particular order among themselves) and returns m. With k > 0, m = k (k <= n);
 * otherwise m is the smallest count whose w-mass reaches target (at least 1; n if none does).
 * Expected O(n), so top-k and top-p never sort the vocabulary. */
static int select_prefix(int32_t *idx, int n, const float *key, const float *w, int k,
                         double target) {
    int lo = 0, hi = n;
    double acc = 0; /* mass of idx[0..lo); stays below target */
    while (hi - lo > 16) {
        int q = partition(idx, lo, hi, key);
        if (k > 0) {
            if (q + 1 == k) return k;
            if (q >= k)
                hi = q;
            else
                lo = q + 1;
        } else {
            double m = 0;
            for (int i = lo; i < q; i++) m += w[idx[i]];
            if (acc + m >= target) {
                hi = q;
            } else if (acc + m + w[idx[q]] >= target) {
                return q + 1;
            } else {
                acc += m + w[idx[q]];
                lo = q + 1;
            }
        }
    }
    sort_small(idx + lo, hi - lo, key);
    if (k > 0) return k;
    for (int i = lo; i < hi; i++) {
        acc += w[idx[i]];
        if (acc >= target) return i + 1;
    }
    return hi;
}

/* Lowest id among the maxima; NaN never wins (0 if everything is NaN). */
static int32_t argmax(const float *x, int n) {
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (best < 0 ? x[i] == x[i] : x[i] > x[best]) best = i;
    return best < 0 ? 0 : best;
}

/* ---- logprobs ----------------------------------------------------------------------------------
 */

/* Fills lp's top list from x[V] (the raw logits) and returns log(sum(exp(x))), so that the
 * logprob of any token is x[i] - result. */
static double raw_logprobs(const float *x, int V, int k, ds_logprobs_out *lp) {
    float mx = -INFINITY;
    int n = 0;
    int32_t *top = lp->top_ids; /* [n] kept in `before` order by insertion */
    for (int i = 0; i < V; i++) {
        float v = x[i];
        if (v != v) continue;
        if (v > mx) mx = v;
        if (n < k || (k > 0 && v > x[top[n - 1]])) {
            int j = n < k ? n++ : k - 1;
            for (; j > 0 && v > x[top[j - 1]]; j--) top[j] = top[j - 1];
            top[j] = i;
        }
    }
    double sum = 0;
    if (mx > -INFINITY)
        for (int i = 0; i < V; i++)
            if (x[i] > -INFINITY) sum += expf(x[i] - mx);
    double lse = (double)mx + log(sum);
    lp->n_top = n;
    for (int j = 0; j < n; j++) lp->top_logprobs[j] = (float)((double)x[top[j]] - lse);
    return lse;
}

/* ---- the draw ----------------------------------------------------------------------------------
 */

/* Probabilities are bucketed by the top bits of their float pattern (exponent and 3 mantissa
 * bits: 8 buckets per octave). For w in (0, 1] the pattern is monotone in w and at most that of
 * 1.0f, which bounds the bucket count. */
#define HIST_SHIFT 20
#define N_BUCKETS  ((int)(0x3f800000u >> HIST_SHIFT) + 1)

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Draws from softmax(logits / T) restricted by top-k, top-p and min-p. u in [0, 1). */
static int32_t draw(const float *logits, int V, const ds_sample_params *p, double u,
                    ds_sample_scratch *s) {
    float mx = logits[argmax(logits, V)];
    /* All masked, or an infinite logit: no distribution to draw from, take the maximum. */
    if (!(mx > -INFINITY) || mx == INFINITY) return argmax(logits, V);
    float inv_t = 1.0f / p->temperature;
    float *w = s->w;
    int top_k = p->top_k > 0 && p->top_k < V ? p->top_k : 0;
    int top_p = p->top_p < 1.0f;
    /* Every w is <= 1 and the maximum's is exactly 1, so min-p's "min_p * p_max" is min_p. */
    float min_w = p->min_p > 0.0f ? DS_MIN(p->min_p, 1.0f) : 0.0f;

    if (!top_k && !top_p) { /* linear: weigh, drop what min-p drops, scan */
        double total = 0;
        for (int i = 0; i < V; i++) {
            float wi = expf((logits[i] - mx) * inv_t);
            if (!(wi >= min_w)) wi = 0.0f; /* also NaN */
            w[i] = wi;
            total += wi;
        }
        double target = u * total, acc = 0;
        int32_t last = 0;
        for (int i = 0; i < V; i++)
            if (w[i] > 0.0f) {
                acc += w[i];
                last = i;
                if (target < acc) return i;
            }
        return last; /* rounding left target at the very end */
    }

    /* Weigh and build the histogram. */
    int cnt[N_BUCKETS];
    double mass[N_BUCKETS];
    memset(cnt, 0, sizeof cnt);
    memset(mass, 0, sizeof mass);
    double total = 0;
    for (int i = 0; i < V; i++) {
        float wi = expf((logits[i] - mx) * inv_t);
        if (!(wi > 0.0f)) wi = 0.0f;
        w[i] = wi;
        if (wi > 0.0f) {
            uint32_t b = bits_of(wi) >> HIST_SHIFT;
            cnt[b]++;
            mass[b] += wi;
            total += wi;
        }
    }
    /* The highest bucket b such that buckets >= b hold the top-k ids or, without top-k, the
     * top-p mass: everything at or above it is a prefix of the order that contains the answer. */
    int b = N_BUCKETS - 1;
    double target_p = (double)p->top_p * total;
    for (long c = 0; b > 0; b--) {
        c += cnt[b];
        if (top_k ? c >= top_k : (target_p -= mass[b]) <= 0) break;
    }
    int32_t *idx = s->idx;
    int n;
    for (;;) {
        float theta = float_of(b ? (uint32_t)b << HIST_SHIFT : 1u); /* b = 0: every w > 0 */
        double gmass = 0;
        n = 0;
        for (int i = 0; i < V; i++)
            if (w[i] >= theta) {
                idx[n++] = i;
                gmass += w[i];
            }
        /* Bucket sums and gmass round differently; on a miss, take everything. */
        if (top_k || b == 0 || gmass >= (double)p->top_p * total) break;
        b = 0;
    }
    if (top_k && n > top_k) n = select_prefix(idx, n, logits, w, top_k, 0);
    if (top_p) {
        double kept = total; /* top-p renormalises over what top-k kept */
        if (top_k) {
            kept = 0;
            for (int j = 0; j < n; j++) kept += w[idx[j]];
        }
        n = select_prefix(idx, n, logits, w, 0, (double)p->top_p * kept);
    }
    double sum = 0;
    for (int j = 0; j < n; j++)
        if (w[idx[j]] >= min_w) sum += w[idx[j]];
    double target = u * sum, acc = 0;
    int32_t last = idx[0];
    for (int j = 0; j < n; j++)
        if (w[idx[j]] >= min_w) {
            acc += w[idx[j]];
            last = idx[j];
            if (target < acc) return idx[j];
        }
    return last;
}

int32_t ds_sample_token(float *logits, int V, const ds_sample_params *p,
                        const ds_token_counts *counts, int allow_stop, const int32_t *stop_ids,
                        int n_stop_ids, ds_rng *rng, ds_sample_scratch *scratch,
                        ds_logprobs_out *lp) {
    int penalise = counts && counts->n && (p->presence_penalty != 0 || p->frequency_penalty != 0);
    int mask = !allow_stop && n_stop_ids > 0;
    const float *raw = logits;
    double lse = 0;
    if (lp) {
        int k = DS_MIN(DS_MAX(p->logprobs, 0), DS_MIN(DS_MAX_LOGPROBS, V));
        lse = raw_logprobs(logits, V, k, lp);
        if (penalise || mask) { /* the sampled token's raw logit must survive the edits below */
            memcpy(scratch->raw, logits, (size_t)V * sizeof(float));
            raw = scratch->raw;
        }
    }
    if (penalise)
        for (int i = 0; i < counts->cap; i++) {
            const ds_token_count *c = &counts->slots[i];
            if (c->id < 0 || c->id >= V) continue;
            logits[c->id] -= p->frequency_penalty * (float)c->count;
            logits[c->id] -= p->presence_penalty;
        }
    if (mask)
        for (int i = 0; i < n_stop_ids; i++)
            if (stop_ids[i] >= 0 && stop_ids[i] < V) logits[stop_ids[i]] = -INFINITY;

    int32_t tok;
    if (!(p->temperature >= GREEDY_TEMPERATURE))
        tok = argmax(logits, V);
    else
        tok = draw(logits, V, p, ds_rng_uniform(rng), scratch);
    if (lp) lp->logprob = (float)((double)raw[tok] - lse);
    return tok;
}

int32_t ds_sample(float *logits, int V, const ds_sampling *p, ds_rng *rng, float *scratch,
                  int32_t *idx) {
    ds_sample_params sp;
    ds_sample_params_default(&sp);
    sp.temperature = p->temperature;
    sp.top_p = p->top_p;
    sp.top_k = p->top_k;
    sp.min_p = p->min_p;
    ds_sample_scratch s = {scratch, idx, NULL, V};
    return ds_sample_token(logits, V, &sp, NULL, 1, NULL, 0, rng, &s, NULL);
}
