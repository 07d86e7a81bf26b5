/* sampler.c — penalties, stop masking, logprobs and the draw; see sampler.h for the contract.
 *
 * The order of a candidate is (logit descending, id ascending): a strict total order, so top-k,
 * top-p and greedy never depend on how ties happen to fall in memory. */
#include "sample/sampler.h"

#include "kernels/cpu/kernels.h"
#include "kernels/shared/draw_exp.h"

#include <math.h>
#include <stdlib.h>

/* Below this temperature vLLM samples greedily; dividing by it would only amplify rounding. */
#define GREEDY_TEMPERATURE 1e-5f

void ds_sample_params_default(ds_sample_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
}

/* ---- token counts ---------------------------------------------------------------------- */

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

int ds_token_counts_init(ds_token_counts *c, ds_err *err) {
    memset(c, 0, sizeof *c);
    return counts_grow(c, err);
}

int ds_token_counts_add(ds_token_counts *c, int32_t id) {
    if (id < 0) return DS_ERR;
    if (2 * (c->n + 1) > c->cap && counts_grow(c, NULL)) return DS_ERR;
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

/* ---- scratch ---------------------------------------------------------------------------- */

ds_sample_scratch *ds_sample_scratch_new(int cap, ds_err *err) {
    ds_sample_scratch *s = ds_calloc(1, sizeof *s, err);
    if (!s) return NULL;
    s->w = ds_malloc((size_t)cap * sizeof(float), err);
    s->idx = s->w ? ds_malloc((size_t)cap * sizeof(int32_t), err) : NULL;
    s->raw = s->idx ? ds_malloc((size_t)cap * sizeof(float), err) : NULL;
    if (!s->raw) {
        ds_sample_scratch_free(s);
        return NULL;
    }
    s->cap = cap;
    return s;
}

void ds_sample_scratch_free(ds_sample_scratch *s) {
    if (!s) return;
    free(s->w);
    free(s->idx);
    free(s->raw);
    free(s);
}

/* ---- loops the compiler can vectorise ---------------------------------------------------- */

#define LANES 8 /* independent accumulators: no reassociation flags needed for packed code */

/* Largest of x[0..n), NaN ignored; -inf when there is nothing else. */
static float max_of(const float *x, int n) {
    float m[LANES];
    for (int j = 0; j < LANES; j++) m[j] = -INFINITY;
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
    for (; i < n; i++) m[0] = x[i] > m[0] ? x[i] : m[0];
    float r = m[0];
    for (int j = 1; j < LANES; j++) r = m[j] > r ? m[j] : r;
    return r;
}

/* Sum of w[0..n) in double (one accumulator would wait on add latency at every element). */
static double sum_of(const float *w, int n) {
    double s[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) s[j] += w[i + j];
    for (; i < n; i++) s[0] += w[i];
    double r = 0;
    for (int j = 0; j < LANES; j++) r += s[j];
    return r;
}

/* exp(x) for x <= 0 within a few ulp (kernels/shared/draw_exp.h: the GPU's draw computes the
 * same bits), vectorised in weigh's loop */
static inline float exp_nonpos(float x) {
    return ds_exp_nonpos(x);
}

/* w[i] = exp((x[i] - mx) * inv_t): unnormalised probabilities in [0, 1], the maximum's exactly
 * 1, NaN and -inf logits 0. */
static void weigh(float *w, const float *x, int n, float mx, float inv_t) {
#pragma omp simd /* the default build is -O2, which would leave this loop scalar */
    for (int i = 0; i < n; i++) w[i] = exp_nonpos((x[i] - mx) * inv_t);
}

void ds_sample_weights(float *w, const float *x, int n, float mx, float inv_t) {
    weigh(w, x, n, mx, inv_t);
}

/* A weight's mass: w * 2^40 (exact in float) truncated to an integer. Sums of masses are exact, so
 * a row's top-p set and its draw do not depend on the order its elements are added in: the GPU's
 * parallel passes reach the token this file's loops reach (ds_cu_draw_rows). A weight below 2^-40
 * (a probability under ~1e-12 of the top token's) has no mass and is never drawn. Up to 2^23
 * tokens of mass <= 2^40 sum below 2^63. */
#define MASS_SCALE 0x1p40f

static inline uint64_t mass_of(float w) {
    return (uint64_t)(int64_t)(w * MASS_SCALE);
}

static uint64_t mass_sum(const float *w, int n) {
    uint64_t s[4] = {0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += mass_of(w[i + j]);
    for (; i < n; i++) s[0] += mass_of(w[i]);
    return s[0] + s[1] + s[2] + s[3];
}

/* The top-p goal over a kept mass: top_p of it, at least 1 (so that a set is never empty). */
static uint64_t top_p_goal(float top_p, uint64_t kept) {
    uint64_t g = (uint64_t)((double)top_p * (double)kept);
    return g ? g : 1;
}

/* ---- ordering and selection -------------------------------------------------------------- */

/* 1 if id a comes before id b: larger logit first, then smaller id. Branch-free: partitions
 * compare in unpredictable order. key holds no NaN where it is asked. */
static inline int before(int32_t a, int32_t b, const float *key) {
    float ka = key[a], kb = key[b];
    return (ka > kb) | ((ka == kb) & (a < b));
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
 * position q: idx[lo..q) come before it, idx(q..hi) after it. The Lomuto loop swaps on every
 * element and advances conditionally, so it has no data-dependent branch. */
static int partition(int32_t *idx, int lo, int hi, const float *key) {
    int mid = lo + (hi - lo) / 2, last = hi - 1;
    if (before(idx[mid], idx[lo], key)) SWAP_IDX(mid, lo);
    if (before(idx[last], idx[lo], key)) SWAP_IDX(last, lo);
    if (before(idx[last], idx[mid], key)) SWAP_IDX(last, mid);
    SWAP_IDX(mid, last); /* the median becomes the pivot */
    int32_t pivot = idx[last];
    int s = lo;
    for (int i = lo; i < last; i++) {
        int32_t v = idx[i];
        idx[i] = idx[s];
        idx[s] = v;
        s += before(v, pivot, key);
    }
    SWAP_IDX(s, last);
    return s;
}

static uint64_t sum_at(const float *w, const int32_t *idx, int n) {
    uint64_t s[4] = {0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += mass_of(w[idx[i + j]]);
    for (; i < n; i++) s[0] += mass_of(w[idx[i]]);
    return s[0] + s[1] + s[2] + s[3];
}

/* Quickselect over idx[0..n): rearranges it so that idx[0..m) are the first m ids in `before`
 * order (in no particular order among themselves) and returns m. With k > 0, m = k (k <= n);
 * otherwise m is the smallest count whose mass reaches target (at least 1; n if none does).
 * Expected O(n), so top-k and top-p never sort the vocabulary. */
static int select_prefix(int32_t *idx, int n, const float *key, const float *w, int k,
                         uint64_t target) {
    int lo = 0, hi = n;
    uint64_t acc = 0; /* mass of idx[0..lo); stays below target */
    while (hi - lo > 16) {
        int q = partition(idx, lo, hi, key);
        if (k > 0) {
            if (q + 1 == k) return k;
            if (q >= k)
                hi = q;
            else
                lo = q + 1;
        } else {
            uint64_t m = sum_at(w, idx + lo, q - lo), mq = mass_of(w[idx[q]]);
            if (acc + m >= target) {
                hi = q;
            } else if (acc + m + mq >= target) {
                return q + 1;
            } else {
                acc += m + mq;
                lo = q + 1;
            }
        }
    }
    sort_small(idx + lo, hi - lo, key);
    if (k > 0) return k;
    for (int i = lo; i < hi; i++) {
        acc += mass_of(w[idx[i]]);
        if (acc >= target) return i + 1;
    }
    return hi;
}

/* ---- logprobs ---------------------------------------------------------------------------- */

/* Fills lp's top list from x[V] (the raw logits) and returns log(sum(exp(x))), so that the
 * logprob of any token is x[i] - result. tmp: [V] scratch. */
static double raw_logprobs(const float *x, int V, int k, ds_logprobs_out *lp, float *tmp) {
    int n = 0;
    int32_t *top = lp->top_ids; /* [n] kept in `before` order by insertion */
    float floor = -INFINITY;    /* once the list is full, what a newcomer must beat */
    for (int i0 = 0; i0 < V && k > 0; i0 += 16) {
        int end = DS_MIN(i0 + 16, V), any = 0;
        for (int i = i0; i < end; i++) any |= x[i] >= floor; /* most blocks hold no newcomer */
        if (!any) continue;
        for (int i = i0; i < end; i++) {
            float v = x[i];
            if (n < k ? v == v : v > floor) { /* NaN never enters; ties keep the lower id */
                int j = n < k ? n++ : k - 1;
                for (; j > 0 && v > x[top[j - 1]]; j--) top[j] = top[j - 1];
                top[j] = i;
                if (n == k) floor = x[top[k - 1]];
            }
        }
    }
    float mx = max_of(x, V);
    weigh(tmp, x, V, mx, 1.0f);
    double lse = (double)mx + log(sum_of(tmp, V));
    lp->n_top = n;
    for (int j = 0; j < n; j++) lp->top_logprobs[j] = (float)((double)x[top[j]] - lse);
    return lse;
}

/* ---- the draw ---------------------------------------------------------------------------- */

/* The draw: with S the mass of w[0..n) and r = floor(u * S) (at most S - 1), the first i, in id
 * order, whose inclusive prefix mass exceeds r. Block sums first, so that only one block is
 * scanned element by element. Some w must have mass (the maximum's weight, 1, always has). */
static int32_t pick_mass(const float *w, int n, double u) {
    enum { MAX_BLOCKS = 256 };
    uint64_t bsum[MAX_BLOCKS]; /* [nb] */
    int bs = DS_MAX(1024, (n + MAX_BLOCKS - 1) / MAX_BLOCKS), nb = (n + bs - 1) / bs;
    uint64_t total = 0;
    for (int b = 0; b < nb; b++)
        total += bsum[b] = mass_sum(w + (size_t)b * bs, DS_MIN(bs, n - b * bs));
    uint64_t r = (uint64_t)(u * (double)total), acc = 0;
    if (r >= total) r = total - 1; /* u * S rounded up to S */
    int b = 0;
    while (b < nb - 1 && acc + bsum[b] <= r) acc += bsum[b++];
    for (int i = b * bs; i < n; i++) {
        acc += mass_of(w[i]);
        if (r < acc) return i;
    }
    return n - 1; /* not reached: r < total */
}

/* Probabilities are bucketed by the top bits of their float pattern (exponent and 2 mantissa
 * bits: 4 buckets per octave). For w in [0, 1] the pattern is monotone in w and at most that of
 * 1.0f, which bounds the bucket count. */
#define HIST_SHIFT 21
#define N_BUCKETS  ((int)(0x3f800000u >> HIST_SHIFT) + 1)

static inline uint32_t bucket_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u >> HIST_SHIFT;
}

/* The bucket b where the goal is reached: the ids with w in buckets above b number fewer than k
 * (k > 0) or hold less than target of the mass (k == 0), and with bucket b they reach it; 0 when
 * even that falls short. Four interleaved histograms, so that runs of equal buckets do not wait
 * on each other's stores. */
static int threshold_bucket(const float *w, int V, int k, uint64_t target) {
    int b = N_BUCKETS - 1;
    if (k > 0) {
        int cnt[4][N_BUCKETS];
        memset(cnt, 0, sizeof cnt);
        int i = 0;
        for (; i + 4 <= V; i += 4)
            for (int j = 0; j < 4; j++) cnt[j][bucket_of(w[i + j])]++;
        for (; i < V; i++) cnt[0][bucket_of(w[i])]++;
        for (long c = 0; b > 0; b--)
            if ((c += cnt[0][b] + cnt[1][b] + cnt[2][b] + cnt[3][b]) >= k) break;
    } else {
        uint64_t mass[4][N_BUCKETS];
        memset(mass, 0, sizeof mass);
        int i = 0;
        for (; i + 4 <= V; i += 4)
            for (int j = 0; j < 4; j++) mass[j][bucket_of(w[i + j])] += mass_of(w[i + j]);
        for (; i < V; i++) mass[0][bucket_of(w[i])] += mass_of(w[i]);
        for (uint64_t m = 0; b > 0; b--)
            if ((m += mass[0][b] + mass[1][b] + mass[2][b] + mass[3][b]) >= target) break;
    }
    return b;
}

/* Gathers the ids with w in bucket b or above: those of higher buckets first, idx[0..*n_above),
 * then those of bucket b; returns how many in all. b = 0 takes every w > 0 below bucket 1. Both
 * groups are prefixes of the candidate order, so when b is where the goal is reached, the first
 * group is wholly kept and only bucket b needs selecting. */
static int gather(const float *w, int V, int b, int32_t *idx, int *n_above) {
    uint32_t lo_bits = b ? (uint32_t)b << HIST_SHIFT : 1u; /* 1: the smallest positive float */
    uint32_t hi_bits = (uint32_t)(b + 1) << HIST_SHIFT;
    float lo, hi;
    memcpy(&lo, &lo_bits, 4);
    memcpy(&hi, &hi_bits, 4);
    int na = 0, nb = 0; /* bucket b grows down from the end, the rest up from the start */
    for (int i0 = 0; i0 < V; i0 += 16) {
        int end = DS_MIN(i0 + 16, V), any = 0;
        for (int i = i0; i < end; i++) any |= w[i] >= lo; /* most blocks hold no candidate */
        if (!any) continue;
        for (int i = i0; i < end; i++) { /* write always, keep conditionally: no branch */
            idx[na] = i;
            idx[V - 1 - nb] = i;
            na += w[i] >= hi;
            nb += (w[i] >= lo) & (w[i] < hi);
        }
    }
    memmove(idx + na, idx + V - nb, (size_t)nb * sizeof *idx);
    *n_above = na;
    return na + nb;
}

/* Zeroes the weight of every id after `last` in the candidate order (logit descending, id
 * ascending): what is left is a prefix of that order, ending with `last`. */
static void keep_through(float *w, const float *x, int V, int32_t last) {
    float xl = x[last];
#pragma omp simd
    for (int i = 0; i < V; i++)
        w[i] = ds_dx_pick((x[i] > xl) | ((x[i] == xl) & (i <= last)), w[i], 0.0f);
}

/* Draws from softmax(logits / T) restricted by top-k, top-p and min-p. u in [0, 1).
 *
 * Exactly (ds_cu_draw_rows computes the same): weights w = exp((x - max) / T) (exp_nonpos, every
 * float operation as written), masses m = mass_of(w); the candidates are the ids with m > 0 in
 * the order (logit descending, id ascending). Top-k keeps the first k of them; top-p then keeps the
 * shortest prefix of those whose mass reaches top_p_goal of theirs; min-p drops ids with
 * w < min_p; the token is pick_mass over what is left, in id order. */
static int32_t draw(const float *logits, int V, const ds_sample_params *p, double u,
                    ds_sample_scratch *s) {
    float mx = max_of(logits, V);
    /* All masked, or an infinite logit: no distribution to draw from, take the maximum. */
    if (!(mx > -INFINITY) || mx == INFINITY) return ds_argmax(logits, V);
    float *w = s->w;
    int32_t *idx = s->idx;
    const ds_draw_numbers nb = ds_sample_numbers(p, V);
    int top_k = nb.top_k, top_p = p->top_p < 1.0f;
    float min_w = nb.min_w;
    weigh(w, logits, V, mx, nb.inv_t);

    if (top_k || top_p) {
        /* The kept prefix, idx[0..n) in no particular order. Ids with weight but no mass may be
         * among top-k's; they are never drawn, and every id after them has no mass either. */
        int n, na;
        if (top_k) {
            n = gather(w, V, threshold_bucket(w, V, top_k, 0), idx, &na);
            if (n > top_k) {
                select_prefix(idx + na, n - na, logits, w, top_k - na, 0);
                n = top_k;
            }
            if (top_p) /* the mass renormalises over what top-k kept */
                n = select_prefix(idx, n, logits, w, 0, top_p_goal(p->top_p, sum_at(w, idx, n)));
        } else {
            uint64_t target = top_p_goal(p->top_p, mass_sum(w, V));
            n = gather(w, V, threshold_bucket(w, V, 0, target), idx, &na);
            uint64_t above = sum_at(w, idx, na); /* exact sums: bucket b is where target falls */
            n = na + select_prefix(idx + na, n - na, logits, w, 0, target - above);
        }
        int32_t last = idx[0]; /* the prefix's end: the last of idx[0..n) in candidate order */
        for (int j = 1; j < n; j++)
            if (before(last, idx[j], logits)) last = idx[j];
        keep_through(w, logits, V, last);
    }
    if (min_w > 0.0f) {
#pragma omp simd
        for (int i = 0; i < V; i++) w[i] = ds_dx_pick(w[i] >= min_w, w[i], 0.0f);
    }
    return pick_mass(w, V, u);
}

/* Penalties over the generated tokens, then the stop ids masked: the logits as they are drawn
 * from. The GPU applies the same float operations in the same order (ds_cu_draw_rows). */
static void edit_logits(float *logits, int V, const ds_sample_params *p,
                        const ds_token_count *counts, int n_counts, const int32_t *mask,
                        int n_mask) {
    if (p->presence_penalty != 0 || p->frequency_penalty != 0)
        for (int i = 0; i < n_counts; i++) {
            const ds_token_count *c = &counts[i];
            if (c->id < 0 || c->id >= V) continue;
            logits[c->id] -= p->frequency_penalty * (float)c->count;
            logits[c->id] -= p->presence_penalty;
        }
    for (int i = 0; i < n_mask; i++)
        if (mask[i] >= 0 && mask[i] < V) logits[mask[i]] = -INFINITY;
}

int ds_sample_draws_uniform(const ds_sample_params *p) {
    return p->temperature >= GREEDY_TEMPERATURE;
}

ds_draw_numbers ds_sample_numbers(const ds_sample_params *p, int V) {
    int greedy = !ds_sample_draws_uniform(p);
    /* Every w is <= 1 and the maximum's is exactly 1, so min-p's "min_p * p_max" is min_p. */
    return (ds_draw_numbers){greedy, greedy ? 0.0f : 1.0f / p->temperature,
                             p->top_k > 0 && p->top_k < V ? p->top_k : 0,
                             p->min_p > 0.0f ? DS_MIN(p->min_p, 1.0f) : 0.0f};
}

int32_t ds_sample_row(float *logits, int V, const ds_row_draw *d, ds_sample_scratch *scratch) {
    edit_logits(logits, V, &d->p, d->counts, d->n_counts, d->mask, d->n_mask);
    if (d->n_allow > 0) ds_sample_mask_bits(logits, V, d->allow, d->n_allow);
    if (!ds_sample_draws_uniform(&d->p)) return ds_argmax(logits, V);
    return draw(logits, V, &d->p, d->u, scratch);
}

int32_t ds_sample_token(float *logits, int V, const ds_sample_params *p,
                        const ds_token_counts *counts, int allow_stop, const int32_t *stop_ids,
                        int n_stop_ids, ds_rng *rng, ds_sample_scratch *scratch,
                        ds_logprobs_out *lp, int n_top) {
    int penalise = counts && counts->n && (p->presence_penalty != 0 || p->frequency_penalty != 0);
    int mask = !allow_stop && n_stop_ids > 0;
    const float *raw = logits;
    double lse = 0;
    if (lp) {
        int k = DS_MIN(DS_MAX(n_top, 0), DS_MIN(DS_MAX_LOGPROBS, V));
        lse = raw_logprobs(logits, V, k, lp, scratch->w);
        if (penalise || mask) { /* the sampled token's raw logit must survive the edits below */
            memcpy(scratch->raw, logits, (size_t)V * sizeof(float));
            raw = scratch->raw;
        }
    }
    /* the table's empty slots (id -1) are skipped like any id outside the vocabulary */
    ds_row_draw d = {*p,
                     0,
                     counts ? counts->slots : NULL,
                     penalise ? counts->cap : 0,
                     stop_ids,
                     mask ? n_stop_ids : 0,
                     NULL,
                     0};
    if (ds_sample_draws_uniform(p)) d.u = ds_rng_uniform(rng);
    int32_t tok = ds_sample_row(logits, V, &d, scratch);
    if (lp) lp->logprob = (float)((double)raw[tok] - lse);
    return tok;
}

int ds_sample_is_argmax(const ds_sample_params *p, int allow_stop, int n_stop_ids, int logprobs) {
    /* the conditions under which ds_sample_token neither edits the logits (penalise, mask) nor
     * reads them for logprobs, and takes the greedy branch */
    return !(p->temperature >= GREEDY_TEMPERATURE) && p->presence_penalty == 0 &&
           p->frequency_penalty == 0 && (allow_stop || n_stop_ids == 0) && logprobs < 0;
}

void ds_sample_mask_bits(float *logits, int V, const uint32_t *allow, int n_bits) {
    int n = DS_MIN(V, n_bits);
    for (int w = 0; w * 32 < n; w++) {
        uint32_t m = allow[w];
        if (m == 0xFFFFFFFFu && w * 32 + 32 <= n) continue;
        if (m == 0 && w * 32 + 32 <= n) { /* outside a string most words forbid every id */
            for (int i = w * 32; i < w * 32 + 32; i++) logits[i] = -INFINITY;
            continue;
        }
        for (int b = 0, i = w * 32; b < 32 && i < n; b++, i++)
            if (!(m >> b & 1u)) logits[i] = -INFINITY;
    }
    for (int i = n; i < V; i++) logits[i] = -INFINITY;
}
