/* sampler.h — turns one row of logits into a token, the way vLLM does for an OpenAI request:
 * presence/frequency penalties over the generated tokens, stop ids masked until min_tokens,
 * logprobs of the raw logits, then greedy or temperature sampling with top-k, top-p and min-p,
 * drawn from the request's own RNG so a seeded request gives the same tokens whatever else is in
 * the batch.
 *
 * Cost is linear in V (about 0.5-1.5 ms at V = 163840 on one core): the weights come from a
 * vectorised exp, a plain draw finds its token through block sums, and top-k / top-p pick the
 * bucket of a probability histogram where their boundary lies and partially select inside it
 * instead of sorting the vocabulary. */
#ifndef DS_SAMPLER_H
#define DS_SAMPLER_H

#include "base/ds_base.h"

#define DS_MAX_LOGPROBS 20 /* the most top_logprobs a request may ask for */

typedef struct ds_sample_params {
    float temperature;                         /* < 1e-5: greedy (lowest id among equal maxima) */
    float top_p;                               /* >= 1: off */
    int top_k;                                 /* <= 0 or >= V: off */
    float min_p;                               /* <= 0: off; keeps p >= min_p * p_max */
    float presence_penalty, frequency_penalty; /* 0: off (OpenAI semantics, generated tokens) */
} ds_sample_params;

void ds_sample_params_default(ds_sample_params *p); /* T 1, top_p 1, everything else off */

/* Token id -> how often it was generated, for one sequence. Open addressing with linear probing:
 * V is 163840 but a request generates few distinct tokens, so a dense [V] array per sequence
 * would cost more to clear than to use. A zero-initialised struct is an empty map. */
typedef struct ds_token_count {
    int32_t id; /* -1: empty slot */
    int32_t count;
} ds_token_count;

typedef struct ds_token_counts {
    ds_token_count *slots; /* [cap] */
    int cap;               /* power of two (0 before the first add) */
    int n;                 /* distinct ids stored; kept <= cap / 2 */
} ds_token_counts;

/* Reserves room for a typical request so that adds rarely allocate. */
int ds_token_counts_init(ds_token_counts *c, ds_err *err);
/* count(id) += 1. DS_ERR (id < 0, or no memory to grow: the count is then lost) is rare enough
 * that the engine may ignore it; penalties would only be slightly off. */
int ds_token_counts_add(ds_token_counts *c, int32_t id);
int ds_token_counts_get(const ds_token_counts *c, int32_t id); /* 0 when absent */
void ds_token_counts_clear(ds_token_counts *c);                /* keeps the memory */
void ds_token_counts_free(ds_token_counts *c);

/* Working memory for one ds_sample_token call at a time (one per sampling thread). */
typedef struct ds_sample_scratch {
    float *w;     /* [cap] unnormalised probabilities exp((logit - max) / T) */
    int32_t *idx; /* [cap] candidate ids for top-k / top-p */
    float *raw;   /* [cap] copy of the raw logits while logprobs are wanted; NULL: none then */
    int cap;      /* the largest V this scratch serves */
} ds_sample_scratch;

ds_sample_scratch *ds_sample_scratch_new(int cap, ds_err *err);
void ds_sample_scratch_free(ds_sample_scratch *s); /* NULL is fine */

typedef struct ds_logprobs_out {
    float logprob;                       /* of the sampled token */
    int n_top;                           /* min(n_top asked, DS_MAX_LOGPROBS, V) */
    int32_t top_ids[DS_MAX_LOGPROBS];    /* [n_top] by logprob descending, ties by id */
    float top_logprobs[DS_MAX_LOGPROBS]; /* [n_top] */
} ds_logprobs_out;

/* Samples one token from logits[V] (V <= scratch->cap), modified in place (penalised and
 * masked). counts: the sequence's generated tokens (NULL: none). !allow_stop (min_tokens not
 * reached): stop_ids[n_stop_ids] get -inf. lp (NULL: no logprobs) receives log_softmax of the
 * logits as they came in, before penalties and temperature: the sampled token's and the n_top
 * best. Greedy calls draw nothing from rng; any other call draws exactly one uniform, so a seeded
 * request stays reproducible. Filters apply in the order top-k, top-p (over the top-k mass),
 * min-p; equal logits are ordered by id, so top_k = 1 is greedy. */
int32_t ds_sample_token(float *logits, int V, const ds_sample_params *p,
                        const ds_token_counts *counts, int allow_stop, const int32_t *stop_ids,
                        int n_stop_ids, ds_rng *rng, ds_sample_scratch *scratch,
                        ds_logprobs_out *lp, int n_top);

/* One row's sampling as a value: what ds_sample_token does without logprobs, its uniform drawn
 * by the caller, so that the row can be sampled where its logits are (ds_seq_batch.draws: on a
 * GPU, without bringing the row to the host). */
typedef struct ds_row_draw {
    ds_sample_params p;
    double u;                     /* [0, 1): read only when ds_sample_draws_uniform(&p) */
    const ds_token_count *counts; /* [n_counts] penalised ids (distinct; id < 0: skipped) */
    int n_counts;
    const int32_t *mask; /* [n_mask] ids set to -inf (stop ids before min_tokens) */
    int n_mask;
    /* constrained decoding: ids allowed, bit i % 32 of allow[i / 32] for i < n_allow; every other
     * id gets -inf (ds_sample_mask_bits). allow: [ceil(n_allow / 32)]; n_allow 0: no mask */
    const uint32_t *allow;
    int n_allow;
} ds_row_draw;

/* Does sampling with these parameters draw a uniform (temperature >= 1e-5), or take the argmax? */
int ds_sample_draws_uniform(const ds_sample_params *p);

/* The numbers a draw reads from p, as draw() uses them (and a GPU must, to return its token):
 * greedy (no uniform drawn), 1 / temperature, top-k (0: off, or not binding at this V) and the
 * min-p floor on weights (0: off). */
typedef struct ds_draw_numbers {
    int greedy;
    float inv_t;
    int top_k;
    float min_w;
} ds_draw_numbers;
ds_draw_numbers ds_sample_numbers(const ds_sample_params *p, int V);

/* Samples one token from logits[V] (edited in place) as d describes. ds_sample_token is this with
 * the counts, stops and uniform of a sequence. The result is defined exactly — integer masses, an
 * order on the candidates, the draw in id order; see draw() in sampler.c — so that another
 * backend computing the same definition returns the same token for the same row and uniform. */
int32_t ds_sample_row(float *logits, int V, const ds_row_draw *d, ds_sample_scratch *scratch);

/* The draw's weights: w[i] = exp((x[i] - mx) * inv_t) within a few ulp, by float operations a
 * GPU can repeat exactly (no library exp); 0 below exp(-87), for -inf and for NaN. */
void ds_sample_weights(float *w, const float *x, int n, float mx, float inv_t);

/* Constrained decoding's mask: logits[i] = -inf for every i < V whose bit (bit i % 32 of
 * allow[i / 32]) is clear or lies beyond n_bits (ids the grammar's vocabulary does not have).
 * allow: [ceil(n_bits / 32)]. Word by word: an all-allowed word costs one compare. */
void ds_sample_mask_bits(float *logits, int V, const uint32_t *allow, int n_bits);

/* Would ds_sample_token return ds_argmax of the logits as they come in, whatever the counts and
 * the RNG hold? Yes for a greedy request with no penalty, nothing masked (allow_stop, or no stop
 * ids) and no logprobs wanted (logprobs < 0): the caller may then take a greedy token found
 * beside the logits (on the GPU, ds_seq_batch.argmax) and skip the call, which draws nothing from
 * the RNG in that case anyway. */
int ds_sample_is_argmax(const ds_sample_params *p, int allow_stop, int n_stop_ids, int logprobs);

#endif
