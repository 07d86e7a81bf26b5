/* Tensor parallelism at the model level (docs/architecture.md invariant 4 without MPI): T threads,
 * each a rank holding its slice of the weights, all-reduce through shared memory. Logits stay
 * within 1e-4 (relative) of one rank and the greedy token of every step is the same — over a
 * prefill long enough for the chunked KDA and expanded MLA forms, then decode steps (recurrent KDA,
 * absorbed MLA), on both presets (K3: latent MoE with its norm after the routed sum; Kimi-Linear:
 * low-rank KDA gate, plain MoE). */
#include "devtools/init_model.h"
#include "model/model.h"
#include "testutil.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BLOCK = 16, PAGES = 16, MAXT = 4 };

static const int STEPS[] = {40, 1, 1, 9}; /* prefill, two decodes, a short chunk */
#define N_STEPS ((int)DS_ARRAY_LEN(STEPS))

static char *make_model(const char *preset, int mxfp4) {
    char *tmp = ds_test_tmpdir();
    char *dir = malloc(strlen(tmp) + 32);
    sprintf(dir, "%s/%s", tmp, preset);
    free(tmp);
    ds_err err = {{0}};
    if (ds_init_model_ex(preset, dir, 0, mxfp4, &err)) fail_msg("%s", err.msg);
    return dir;
}

/* The group's shared all-reduce: every rank posts its buffer, each sums all of them in rank order
 * (so every rank gets the same bits), and nobody leaves before all have read. */
typedef struct group {
    int T;
    pthread_barrier_t bar;
    float *bufs[MAXT];
    size_t n[MAXT];
    int mismatch;
} group;

typedef struct rank {
    group *g;
    int r;
    const char *dir;
    const int32_t *ids;
    float *logits;          /* [N_STEPS][V] last-token logits of each step (even ranks) */
    int32_t picks[N_STEPS]; /* the greedy token the model picked beside them (every rank) */
    size_t slot_floats, weight_bytes;
    char err[1024];
} rank;

static int group_allreduce(void *ctx, float *buf, size_t n) {
    rank *k = ctx;
    group *g = k->g;
    g->bufs[k->r] = buf;
    g->n[k->r] = n;
    pthread_barrier_wait(&g->bar);
    float *sum = malloc(n * sizeof(float));
    for (int q = 0; q < g->T; q++)
        if (g->n[q] != n) g->mismatch = 1;
    for (size_t i = 0; i < n && !g->mismatch; i++) {
        float s = 0;
        for (int q = 0; q < g->T; q++) s += g->bufs[q][i];
        sum[i] = s;
    }
    pthread_barrier_wait(&g->bar);
    memcpy(buf, sum, n * sizeof(float));
    free(sum);
    return g->mismatch ? DS_ERR : DS_OK;
}

/* The group's all-gather: every rank posts its part and copies all of them in rank order. */
static int group_allgather(void *ctx, const float *mine, size_t n, float *all) {
    rank *k = ctx;
    group *g = k->g;
    g->bufs[k->r] = (float *)mine;
    g->n[k->r] = n;
    pthread_barrier_wait(&g->bar);
    for (int q = 0; q < g->T; q++) {
        if (g->n[q] != n) g->mismatch = 1;
        if (!g->mismatch) memcpy(all + (size_t)q * n, g->bufs[q], n * sizeof(float));
    }
    pthread_barrier_wait(&g->bar);
    return g->mismatch ? DS_ERR : DS_OK;
}

static void *run_rank(void *arg) {
    rank *k = arg;
    ds_model_opts o;
    ds_model_opts_default(&o);
    o.tp_rank = k->r;
    o.tp_size = k->g->T;
    o.allreduce = group_allreduce;
    o.allreduce_ctx = k;
    o.allgather = group_allgather;
    o.allgather_ctx = k;
    ds_model *m;
    ds_kv_pool pool;
    ds_err err = {{0}};
    if (ds_model_load(k->dir, &o, &m, &err)) {
        snprintf(k->err, sizeof k->err, "%s", err.msg);
        return NULL;
    }
    int V = ds_model_config(m)->vocab_size;
    k->slot_floats = ds_model_slot_floats(m);
    k->weight_bytes = ds_model_weight_bytes(m);
    float *slot = calloc(k->slot_floats, sizeof(float));
    int32_t table[PAGES];
    for (int i = 0; i < PAGES; i++) table[i] = (i * 3 + 2) % PAGES;
    if (ds_kv_pool_init(&pool, m, PAGES, BLOCK, &err))
        snprintf(k->err, sizeof k->err, "%s", err.msg);
    for (int s = 0, pos = 0; s < N_STEPS && !k->err[0]; pos += STEPS[s], s++) {
        /* odd ranks ask for the greedy token alone: the all-gather is the same collective */
        ds_seq_batch sb = {k->ids + pos,
                           STEPS[s],
                           pos,
                           slot,
                           table,
                           k->r % 2 ? NULL : k->logits + (size_t)s * V,
                           1,
                           NULL,
                           NULL,
                           NULL,
                           0,
                           NULL,
                           NULL,
                           k->picks + s,
                           NULL};
        if (ds_model_forward(m, &pool, &sb, 1, &err))
            snprintf(k->err, sizeof k->err, "%s", err.msg);
    }
    free(slot);
    ds_kv_pool_free(&pool);
    ds_model_free(m);
    return NULL;
}

/* Runs the steps on T ranks; returns rank 0's logits [N_STEPS][V] (every rank's must agree). */
static float *run_tp(const char *dir, int T, const int32_t *ids, int V, size_t *slot_floats,
                     size_t *weight_bytes) {
    group g = {.T = T};
    pthread_barrier_init(&g.bar, NULL, (unsigned)T);
    rank ranks[MAXT];
    pthread_t th[MAXT];
    for (int r = 0; r < T; r++) {
        ranks[r] =
            (rank){&g, r, dir, ids, calloc((size_t)N_STEPS * V, sizeof(float)), {0}, 0, 0, ""};
        assert_int_equal(pthread_create(&th[r], NULL, run_rank, &ranks[r]), 0);
    }
    for (int r = 0; r < T; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g.bar);
    assert_false(g.mismatch);
    for (int r = 0; r < T; r++)
        if (ranks[r].err[0]) fail_msg("T=%d rank %d: %s", T, r, ranks[r].err);
    /* Vocabulary-parallel lm_head, gathered: the ranks agree bit for bit, and every rank's
     * greedy token (found over the gathered blocks) is the argmax of the logits. */
    for (int s = 0; s < N_STEPS; s++)
        assert_int_equal(ranks[0].picks[s], ds_argmax(ranks[0].logits + (size_t)s * V, V));
    for (int r = 1; r < T; r++) {
        if (r % 2 == 0)
            assert_memory_equal(ranks[r].logits, ranks[0].logits,
                                (size_t)N_STEPS * V * sizeof(float));
        assert_memory_equal(ranks[r].picks, ranks[0].picks, sizeof ranks[0].picks);
        free(ranks[r].logits);
    }
    *slot_floats = ranks[0].slot_floats;
    *weight_bytes = ranks[0].weight_bytes;
    return ranks[0].logits;
}

/* mxfp4: the routed experts as K3 publishes them (split whole, so as exact as BF16 ones). */
static void check_preset(const char *preset, int mxfp4) {
    char *dir = make_model(preset, mxfp4);
    ds_model *m;
    ds_err err = {{0}};
    if (ds_model_load(dir, NULL, &m, &err)) fail_msg("%s", err.msg);
    int V = ds_model_config(m)->vocab_size;
    ds_model_free(m);
    int32_t ids[64];
    ds_rng rng;
    ds_rng_seed(&rng, 5);
    for (int i = 0; i < 64; i++) ids[i] = (int32_t)(ds_rng_next(&rng) % 700);
    size_t slot1, bytes1;
    float *ref = run_tp(dir, 1, ids, V, &slot1, &bytes1);
    for (int T = 2; T <= 4; T *= 2) {
        size_t slot, bytes;
        float *got = run_tp(dir, T, ids, V, &slot, &bytes);
        for (int s = 0; s < N_STEPS; s++) {
            const float *a = got + (size_t)s * V, *b = ref + (size_t)s * V;
            double rel = ds_test_rel_err_f(a, b, (size_t)V);
            if (rel > 1e-4) fail_msg("%s T=%d step %d: relative error %.3g", preset, T, s, rel);
            assert_int_equal(ds_argmax(a, V), ds_argmax(b, V));
        }
        /* The KDA slot holds only this rank's heads; the weights are mostly split. */
        assert_int_equal(slot * (size_t)T, slot1);
        assert_true(bytes < bytes1);
        free(got);
    }
    free(ref);
    free(dir);
}

static void test_tp_k3(void **state) {
    (void)state;
    check_preset("tiny-k3", 0);
}

static void test_tp_k3_mxfp4(void **state) {
    (void)state;
    check_preset("tiny-k3", 1);
}

static void test_tp_linear(void **state) {
    (void)state;
    check_preset("tiny-linear", 0);
}

/* A split that does not divide is refused at load, naming every quantity that does not. */
static void test_tp_indivisible(void **state) {
    (void)state;
    char *dir = make_model("tiny-k3", 0);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    ds_config c;
    ds_err err = {{0}};
    if (ds_config_load(path, &c, &err)) fail_msg("%s", err.msg);
    assert_int_equal(ds_model_tp_check(&c, 3, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "tensor parallel size 3 does not divide"));
    assert_non_null(strstr(err.msg, "4 KDA heads"));
    assert_non_null(strstr(err.msg, "4 MLA heads"));
    assert_non_null(strstr(err.msg, "8 routed experts"));
    assert_non_null(strstr(err.msg, "shared-expert intermediate size 32"));
    assert_null(strstr(err.msg, "dense intermediate")); /* 96 divides by 3 */
    assert_int_equal(ds_model_tp_check(&c, 4, &err), DS_OK);
    ds_model_opts o;
    ds_model_opts_default(&o);
    o.tp_size = 8;
    o.allreduce = group_allreduce;
    o.allgather = group_allgather;
    ds_model *m = NULL;
    assert_int_equal(ds_model_load(dir, &o, &m, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "tensor parallel size 8 does not divide the model's 4 KDA"));
    o.tp_size = 2;
    o.allreduce = NULL; /* a split without a way to sum is a caller's bug, reported */
    assert_int_equal(ds_model_load(dir, &o, &m, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "needs an all-reduce"));
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tp_k3),
        cmocka_unit_test(test_tp_k3_mxfp4),
        cmocka_unit_test(test_tp_linear),
        cmocka_unit_test(test_tp_indivisible),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
