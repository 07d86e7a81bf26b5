/* engine_harness.h — whole engines on a tiny model, for the engine's tests (test_engine_*.c): the
 * model's checkpoint, engines started and stopped, requests submitted with a collector that keeps
 * every choice's tokens, logprobs, text and final events, greedy runs, seeded prompts, and waits
 * until an engine is idle. Linked only into the engine's tests (CMakeLists.txt), since it needs
 * ds_engine. */
#ifndef DS_TEST_ENGINE_HARNESS_H
#define DS_TEST_ENGINE_HARNESS_H

#include "engine/engine.h"
#include "kernels/shared/kv_row.h"
#include "testutil.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define H_MAX_CHOICES 4
#define H_MAX_GEN     256 /* tokens kept per choice; later ones are only counted */
#define H_MAX_TEXT    4096

/* The tiny-k3 checkpoint, written once per test process under its temporary folder. */
const char *h_model_dir(void);
/* Bytes of one KDA state slot of the tiny model (to size checkpoint pools in slots). */
size_t h_slot_bytes(void);

/* What one request's callback collected, per choice. */
typedef struct h_req {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_choices, n_final;                   /* choices, final events seen (all choices) */
    int32_t tokens[H_MAX_CHOICES][H_MAX_GEN]; /* [choice][n] the first tokens */
    float logprobs[H_MAX_CHOICES][H_MAX_GEN]; /* [choice][n] theirs (when logprobs >= 0) */
    int n[H_MAX_CHOICES];                     /* tokens kept */
    int n_seen[H_MAX_CHOICES];                /* tokens seen, kept or not */
    char text[H_MAX_CHOICES][H_MAX_TEXT];     /* [choice][text_len] the text deltas, joined */
    size_t text_len[H_MAX_CHOICES];
    int n_finals[H_MAX_CHOICES]; /* final events of each choice (exactly one is right) */
    ds_finish why[H_MAX_CHOICES];
} h_req;

void h_req_init(h_req *c, int n_choices);
void h_on_event(void *user, const ds_token_event *ev); /* user: an h_req */
void h_wait(h_req *c);                                 /* until every choice has finished */

ds_engine *h_start(const ds_engine_opts *o); /* created and started, or the test fails */
void h_stop(ds_engine *e);                   /* stopped (1 s of grace) and freed */

/* Submits spec with c collecting its events (c reset for spec->params.n choices; spec's callback
 * set to it). Returns the request's id; a refused submit fails the test. */
int64_t h_submit_spec(ds_engine *e, ds_request_spec *spec, h_req *c);

/* Options of the prefix-cache tests: block 16, chunk 64 (= max_num_batched_tokens), rungs every
 * 48 tokens, 8 sequences, a 512-token context. */
void h_opts(ds_engine_opts *o, int prefix_on, size_t kv_mem);
/* The latent cache's dtype h_opts asks for (DS_KV_*, --kv-cache-dtype; 0: f32 rows). */
extern int h_kv_dtype;
/* A greedy request that runs its full length (eos ignored): more decode after forks. */
void h_submit(ds_engine *e, const int32_t *prompt, int n, int max_tokens, h_req *c);
/* Runs one such request to completion, asserting it finished by length; out: its tokens
 * [max_tokens]. */
void h_run(ds_engine *e, const int32_t *prompt, int n, int max_tokens, int32_t *out);
/* The same with the sampled token's logprob; out: its tokens and logprobs [gen]. */
void h_run_lp(ds_engine *e, const int32_t *prompt, int n, int gen, int32_t *tok, float *lp);

/* ids[n]: tokens below 700 from a seeded RNG. */
void h_prompt(int32_t *ids, int n, uint64_t seed);

/* Waits (up to 3 s) until nothing runs or waits and every slot is back, and asserts it;
 * h_assert_idle also wants every page back (idle cached pages count as free). */
void h_assert_no_sequences(ds_engine *e);
void h_assert_idle(ds_engine *e);
/* Stats once the engine is idle (it refreshes them right after each step). */
ds_engine_stats h_stats(ds_engine *e);

#endif
