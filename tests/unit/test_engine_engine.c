/* The engine end to end, without HTTP: greedy requests give exactly the tokens of a plain
 * single-sequence greedy loop over the model (whatever else is in the batch — invariant 7),
 * aborts and shutdown deliver final events, and every page and slot returns to its pool. */
#include "engine_harness.h"

#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static ds_engine *start_engine_spec(int max_num_seqs, int budget_tokens, size_t mem, int method,
                                    int k, void *hook, void *hook_ctx);

static ds_engine *start_engine(int max_num_seqs, int budget_tokens, size_t mem) {
    return start_engine_spec(max_num_seqs, budget_tokens, mem, DS_SPEC_NONE, 0, NULL, NULL);
}

/* The tests' engine: the tiny model, block 16, these limits. */
static void engine_opts(ds_engine_opts *o, int max_num_seqs, int budget_tokens, size_t mem) {
    ds_engine_opts_default(o);
    o->model_dir = h_model_dir();
    o->block_size = 16;
    o->max_num_seqs = max_num_seqs;
    o->max_num_batched_tokens = budget_tokens;
    o->kv_cache_memory = mem;
}

static ds_engine *start_engine_spec(int max_num_seqs, int budget_tokens, size_t mem, int method,
                                    int k, void *hook, void *hook_ctx) {
    ds_engine_opts o;
    engine_opts(&o, max_num_seqs, budget_tokens, mem);
    o.speculative_method = method;
    if (k) o.num_speculative_tokens = k;
    o.test.spec_drafts = hook;
    o.test.spec_ctx = hook_ctx;
    return h_start(&o);
}

enum { STOP_NONE = -1, STOP_EOS = -2 }; /* reference_stop's stop: none, the model's eos */

/* Greedy reference: one sequence, prompt in one forward, then token by token, until `stop` comes
 * out; while fewer than min_tokens are out, stop's logit is -inf (the engine's rule for
 * min_tokens). */
static void reference_stop(const int32_t *prompt, int n_prompt, int max_tokens, int32_t stop,
                           int min_tokens, int32_t *out, int *n_out) {
    ds_model *m;
    ds_err err = {{0}};
    if (ds_model_load(h_model_dir(), NULL, &m, &err)) fail_msg("%s", err.msg);
    const ds_config *c = ds_model_config(m);
    ds_kv_pool pool;
    if (ds_kv_pool_init(&pool, m, 64, 16, &err)) fail_msg("%s", err.msg);
    int32_t table[64];
    for (int i = 0; i < 64; i++) table[i] = i;
    float *slot = calloc(ds_model_slot_floats(m), sizeof(float));
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    int32_t seq[1024];
    memcpy(seq, prompt, (size_t)n_prompt * sizeof(int32_t));
    int len = n_prompt, pos = 0;
    if (stop == STOP_EOS) stop = c->eos_token_id;
    *n_out = 0;
    while (*n_out < max_tokens) {
        ds_seq_batch sb = {seq + pos, len - pos, pos, slot, table, logits, 1,   NULL,
                           NULL,      NULL,      0,   NULL, NULL,  NULL,   NULL};
        if (ds_model_forward(m, &pool, &sb, 1, &err)) fail_msg("%s", err.msg);
        pos = len;
        if (stop >= 0 && *n_out < min_tokens) logits[stop] = -INFINITY;
        int32_t t = (int32_t)ds_argmax(logits, c->vocab_size);
        out[(*n_out)++] = t;
        if (t == stop) break;
        seq[len++] = t;
    }
    free(slot);
    free(logits);
    ds_kv_pool_free(&pool);
    ds_model_free(m);
}

static void reference_greedy(const int32_t *prompt, int n_prompt, int max_tokens, int32_t *out,
                             int *n_out) {
    reference_stop(prompt, n_prompt, max_tokens, STOP_EOS, 0, out, n_out);
}

static int64_t submit(ds_engine *e, const int32_t *prompt, int n, int max_tokens, h_req *c,
                      int n_choices, float temperature, uint64_t seed) {
    ds_request_spec spec = {0};
    spec.prompt = prompt;
    spec.n_prompt = n;
    ds_request_params_default(&spec.params);
    spec.params.sample.temperature = temperature;
    spec.params.max_tokens = max_tokens;
    spec.params.n = n_choices;
    spec.params.has_seed = 1;
    spec.params.seed = seed;
    return h_submit_spec(e, &spec, c);
}

/* Greedy tokens equal the reference, alone and inside a busy batch of other requests. */
static void test_greedy_matches_reference_in_batch(void **state) {
    (void)state;
    int32_t prompt[100];
    h_prompt(prompt, 100, 11);
    int32_t ref[64];
    int n_ref;
    reference_greedy(prompt, 100, 24, ref, &n_ref);

    ds_engine *e = start_engine(16, 256, 64u << 20);
    h_req alone;
    submit(e, prompt, 100, 24, &alone, 1, 0.0f, 0);
    h_wait(&alone);
    assert_int_equal(alone.n[0], n_ref);
    assert_memory_equal(alone.tokens[0], ref, (size_t)n_ref * sizeof(int32_t));

    /* the same request among 12 others of varied lengths, some sampled */
    h_req *others = calloc(12, sizeof *others);
    int32_t op[12][300];
    h_req busy;
    for (int i = 0; i < 12; i++) {
        int n = 5 + i * 23;
        h_prompt(op[i], n, 100 + (uint64_t)i);
        submit(e, op[i], n, 10 + i, &others[i], 1 + i % 2, i % 3 ? 0.8f : 0.0f, (uint64_t)i);
        if (i == 5) submit(e, prompt, 100, 24, &busy, 1, 0.0f, 0);
    }
    h_wait(&busy);
    for (int i = 0; i < 12; i++) h_wait(&others[i]);
    assert_int_equal(busy.n[0], n_ref);
    assert_memory_equal(busy.tokens[0], ref, (size_t)n_ref * sizeof(int32_t));
    for (int i = 0; i < 12; i++)
        for (int j = 0; j < others[i].n_choices; j++) {
            assert_true(others[i].why[j] == DS_FINISH_LENGTH || others[i].why[j] == DS_FINISH_STOP);
            if (others[i].why[j] == DS_FINISH_LENGTH) assert_int_equal(others[i].n[j], 10 + i);
        }
    h_assert_idle(e);
    h_stop(e);
    free(others);
}

/* min_tokens holds a stop id back: while fewer tokens than min_tokens are out the engine masks it
 * and samples on the host (the model's own greedy pick may be that id), afterwards the model
 * picks greedy tokens beside the logits and the stop id ends the choice — both against a
 * reference that masks the same way, alone and beside plain greedy requests. */
static void test_greedy_min_tokens(void **state) {
    (void)state;
    int32_t prompt[100];
    h_prompt(prompt, 100, 11);
    int32_t free_run[64], want[64];
    int n_free, n_want;
    reference_stop(prompt, 100, 16, STOP_NONE, 0, free_run, &n_free);
    const int32_t stop = free_run[2];
    reference_stop(prompt, 100, 16, stop, 5, want, &n_want);
    assert_int_not_equal(want[2], stop); /* the mask mattered */
    ds_engine *e = start_engine(8, 256, 32u << 20);
    for (int crowd = 0; crowd < 2; crowd++) {
        h_req got, others[3];
        int32_t op[3][50];
        ds_request_spec spec = {0};
        spec.prompt = prompt;
        spec.n_prompt = 100;
        ds_request_params_default(&spec.params);
        spec.params.sample.temperature = 0.0f;
        spec.params.max_tokens = 16;
        spec.params.ignore_eos = 1;
        spec.params.min_tokens = 5;
        spec.params.stop_token_ids[0] = stop;
        spec.params.n_stop_token_ids = 1;
        for (int i = 0; crowd && i < 3; i++) {
            h_prompt(op[i], 20 + 10 * i, 70 + (uint64_t)i);
            submit(e, op[i], 20 + 10 * i, 12, &others[i], 1, 0.0f, 0);
        }
        h_submit_spec(e, &spec, &got);
        h_wait(&got);
        for (int i = 0; crowd && i < 3; i++) h_wait(&others[i]);
        assert_int_equal(got.n[0], n_want);
        assert_memory_equal(got.tokens[0], want, (size_t)n_want * sizeof(int32_t));
        assert_int_equal(got.why[0], want[n_want - 1] == stop ? DS_FINISH_STOP : DS_FINISH_LENGTH);
    }
    h_stop(e);
}

/* Same seed, same sampled tokens; the two choices of an n=2 request differ. */
static void test_seeded_sampling(void **state) {
    (void)state;
    ds_engine *e = start_engine(8, 256, 32u << 20);
    int32_t prompt[20];
    h_prompt(prompt, 20, 5);
    h_req a, b;
    submit(e, prompt, 20, 30, &a, 2, 1.0f, 1234);
    h_wait(&a);
    submit(e, prompt, 20, 30, &b, 2, 1.0f, 1234);
    h_wait(&b);
    assert_int_equal(a.n[0], b.n[0]);
    assert_memory_equal(a.tokens[0], b.tokens[0], (size_t)a.n[0] * sizeof(int32_t));
    assert_memory_equal(a.tokens[1], b.tokens[1], (size_t)a.n[1] * sizeof(int32_t));
    int differ =
        a.n[0] != a.n[1] || memcmp(a.tokens[0], a.tokens[1], (size_t)a.n[0] * sizeof(int32_t)) != 0;
    assert_true(differ);
    /* Sampled alone (the only row sampled on the host: one thread) and among 6 other sampled
     * requests (the step's rows sampled side by side on the engine's threads): the same tokens. */
    h_req solo, crowd, others[6];
    submit(e, prompt, 20, 30, &solo, 1, 1.0f, 99);
    h_wait(&solo);
    int32_t op[6][40];
    for (int i = 0; i < 6; i++) {
        h_prompt(op[i], 12 + 4 * i, 900 + (uint64_t)i);
        submit(e, op[i], 12 + 4 * i, 30, &others[i], 1 + i % 2, 0.9f, 40 + (uint64_t)i);
        if (i == 2) submit(e, prompt, 20, 30, &crowd, 1, 1.0f, 99);
    }
    h_wait(&crowd);
    for (int i = 0; i < 6; i++) h_wait(&others[i]);
    assert_int_equal(crowd.n[0], solo.n[0]);
    assert_memory_equal(crowd.tokens[0], solo.tokens[0], (size_t)solo.n[0] * sizeof(int32_t));
    h_stop(e);
}

/* Under a pool too small for everyone, requests are preempted and recomputed, all finish, and
 * the pools come back empty. Aborted requests get a final "abort" event. */
static void test_pressure_and_abort(void **state) {
    (void)state;
    /* ~40 pages of 16 tokens: far less than 24 requests x ~150 tokens */
    ds_engine *e = start_engine(8, 64, 600u << 10);
    enum { N = 24 };
    h_req *c = calloc(N, sizeof *c);
    int32_t(*p)[200] = calloc(N, sizeof *p);
    int64_t ids[N];
    for (int i = 0; i < N; i++) {
        h_prompt(p[i], 30 + i * 3, 500 + (uint64_t)i);
        ids[i] = submit(e, p[i], 30 + i * 3, 120, &c[i], 1, 0.0f, 0);
    }
    for (int i = 0; i < N; i += 5) ds_engine_abort(e, ids[i]);
    for (int i = 0; i < N; i++) h_wait(&c[i]);
    for (int i = 0; i < N; i++) {
        if (i % 5 == 0)
            assert_true(c[i].why[0] == DS_FINISH_ABORT || c[i].n[0] > 0);
        else
            assert_true(c[i].why[0] == DS_FINISH_LENGTH || c[i].why[0] == DS_FINISH_STOP);
    }
    ds_engine_stats st;
    ds_engine_get_stats(e, &st);
    print_message("preemptions: %llu\n", (unsigned long long)st.preemptions_total);
    assert_true(st.preemptions_total > 0);
    h_assert_idle(e);
    h_stop(e);
    free(c);
    free(p);
}

/* Oracle drafts for invariant 6: the true greedy continuation for `want` positions, then wrong
 * tokens, with `want` cycling through 0..k so every accepted count happens. */
typedef struct oracle {
    const int32_t *ref;
    int n_ref, n_prompt, calls;
} oracle;

static int oracle_drafts(void *ctx, const int32_t *tokens, int n_tokens, int k, int32_t *drafts) {
    oracle *o = ctx;
    (void)tokens;
    int g = n_tokens - o->n_prompt; /* generated so far; drafts guess ref[g..] */
    int want = o->calls++ % (k + 1);
    for (int i = 0; i < k; i++) {
        int32_t truth = g + i < o->n_ref ? o->ref[g + i] : 1;
        drafts[i] = i < want ? truth : (truth + 7) % 700;
    }
    return k;
}

/* Invariant 6: greedy output with speculation equals plain greedy output, at every accepted
 * count from 0 to k, with oracle drafts, the DSpark draft and n-gram drafts, alone and in a
 * batch under pool pressure. */
static void test_spec_greedy_equals_plain(void **state) {
    (void)state;
    enum { K = 4, NP = 60, MT = 40 };
    int32_t prompt[NP];
    h_prompt(prompt, NP, 21);
    int32_t ref[MT];
    int n_ref;
    reference_greedy(prompt, NP, MT, ref, &n_ref);

    oracle o = {ref, n_ref, NP, 0};
    ds_engine *e = start_engine_spec(8, 256, 32u << 20, DS_SPEC_DSPARK, K, oracle_drafts, &o);
    h_req c;
    submit(e, prompt, NP, MT, &c, 1, 0.0f, 0);
    h_wait(&c);
    assert_int_equal(c.n[0], n_ref);
    assert_memory_equal(c.tokens[0], ref, (size_t)n_ref * sizeof(int32_t));
    ds_engine_stats st;
    ds_engine_get_stats(e, &st);
    print_message("oracle: %llu verifies, %llu drafts accepted, all %d accepted %llu times\n",
                  (unsigned long long)st.spec_verifies, (unsigned long long)st.spec_accepted_tokens,
                  K, (unsigned long long)st.spec_accepted_at[K - 1]);
    assert_true(st.spec_verifies > 0);
    assert_true(st.spec_accepted_at[K - 1] > 0);            /* a = k happened */
    assert_true(st.spec_verifies > st.spec_accepted_at[0]); /* a = 0 happened */
    assert_true(st.spec_emitted_tokens > st.spec_verifies); /* > 1 token per verify */
    h_stop(e);

    int methods[2] = {DS_SPEC_DSPARK, DS_SPEC_NGRAM};
    for (int mi = 0; mi < 2; mi++) {
        /* tight pools: 8 requests, preemption likely; the first is the one checked */
        e = start_engine_spec(4, 64, 600u << 10, methods[mi], K, NULL, NULL);
        h_req *cs = calloc(8, sizeof *cs);
        int32_t others[7][120];
        submit(e, prompt, NP, MT, &cs[0], 1, 0.0f, 0);
        for (int i = 1; i < 8; i++) {
            h_prompt(others[i - 1], 30 + 10 * i, 900 + (uint64_t)i);
            submit(e, others[i - 1], 30 + 10 * i, 60, &cs[i], 1 + i % 2, i % 2 ? 0.9f : 0.0f,
                   (uint64_t)i);
        }
        for (int i = 0; i < 8; i++) h_wait(&cs[i]);
        assert_int_equal(cs[0].n[0], n_ref);
        assert_memory_equal(cs[0].tokens[0], ref, (size_t)n_ref * sizeof(int32_t));
        ds_engine_get_stats(e, &st);
        assert_true(st.spec_verifies > 0);
        h_assert_idle(e);
        h_stop(e);
        free(cs);
    }
}

/* Drafts from the model itself: its greedy continuation of the sequence (so they are often
 * accepted under sampling, and sometimes not). */
typedef struct model_drafts {
    ds_model *m;
    ds_kv_pool pool;
    int32_t table[64];
    float *slot, *logits;
} model_drafts;

static void model_drafts_open(model_drafts *md) {
    ds_err err = {{0}};
    if (ds_model_load(h_model_dir(), NULL, &md->m, &err)) fail_msg("%s", err.msg);
    if (ds_kv_pool_init(&md->pool, md->m, 64, 16, &err)) fail_msg("%s", err.msg);
    for (int i = 0; i < 64; i++) md->table[i] = i;
    md->slot = calloc(ds_model_slot_floats(md->m), sizeof(float));
    md->logits = malloc((size_t)ds_model_config(md->m)->vocab_size * sizeof(float));
}

static void model_drafts_close(model_drafts *md) {
    free(md->slot);
    free(md->logits);
    ds_kv_pool_free(&md->pool);
    ds_model_free(md->m);
}

static int greedy_drafts(void *ctx, const int32_t *tokens, int n_tokens, int k, int32_t *drafts) {
    model_drafts *md = ctx;
    int V = ds_model_config(md->m)->vocab_size;
    int32_t seq[256];
    if (n_tokens + k > 256) return 0;
    memcpy(seq, tokens, (size_t)n_tokens * sizeof(int32_t));
    memset(md->slot, 0, ds_model_slot_floats(md->m) * sizeof(float));
    int pos = 0, len = n_tokens;
    ds_err err;
    for (int i = 0; i < k; i++) {
        ds_seq_batch sb = {seq + pos, len - pos, pos, md->slot, md->table, md->logits, 1,   NULL,
                           NULL,      NULL,      0,   NULL,     NULL,      NULL,       NULL};
        if (ds_model_forward(md->m, &md->pool, &sb, 1, &err)) return 0;
        pos = len;
        drafts[i] = seq[len++] = ds_argmax(md->logits, V);
    }
    return k;
}

/* The stochastic rule preserves the target distribution (issue 6): with temperature 0.7 and
 * top_k 3 (27 possible 3-token continuations), 600 seeded requests with speculation and 600
 * without give the same distribution by a two-sample chi-square test. Each emitted token draws
 * exactly one uniform from the request's RNG in both modes, so nearly every seed even gives the
 * same tokens; a rule that accepted drafts too often, or a wrong rollback, shows in both checks. */
static void test_spec_sampling_preserves_distribution(void **state) {
    (void)state;
    /* the plain build's 600 seeds give the chi-square its power (DS_TEST_REPS) */
    enum { N = DS_TEST_REPS(600), NP = 20, MT = 3, K = 2 };
    int32_t prompt[NP];
    h_prompt(prompt, NP, 33);
    model_drafts md;
    model_drafts_open(&md);
    int32_t(*out)[2][MT] = calloc(N, sizeof *out); /* [seed][mode][token] */
    uint64_t accepted = 0, drafted = 0;
    for (int mode = 0; mode < 2; mode++) {
        ds_engine *e =
            mode ? start_engine_spec(16, 256, 32u << 20, DS_SPEC_DSPARK, K, greedy_drafts, &md)
                 : start_engine(16, 256, 32u << 20);
        for (int i = 0; i < N; i += 16) {
            h_req c[16];
            int n = DS_MIN(16, N - i);
            for (int j = 0; j < n; j++) {
                ds_request_spec spec = {0};
                spec.prompt = prompt;
                spec.n_prompt = NP;
                ds_request_params_default(&spec.params);
                spec.params.sample.temperature = 0.7f;
                spec.params.sample.top_k = 3;
                spec.params.max_tokens = MT;
                spec.params.ignore_eos = 1;
                spec.params.has_seed = 1;
                spec.params.seed = (uint64_t)(i + j);
                h_submit_spec(e, &spec, &c[j]);
            }
            for (int j = 0; j < n; j++) {
                h_wait(&c[j]);
                assert_int_equal(c[j].n[0], MT);
                memcpy(out[i + j][mode], c[j].tokens[0], sizeof out[0][0]);
            }
        }
        if (mode) {
            ds_engine_stats st;
            ds_engine_get_stats(e, &st);
            accepted = st.spec_accepted_tokens;
            drafted = st.spec_draft_tokens;
        }
        h_stop(e);
    }
    /* both branches of the rule ran */
    print_message("drafts accepted: %llu of %llu\n", (unsigned long long)accepted,
                  (unsigned long long)drafted);
    assert_true(accepted > 0 && accepted < drafted);
    /* two-sample chi-square over the distinct continuations */
    int same = 0, n_cells = 0;
    int32_t cell[2 * N][MT];
    int cnt[2 * N][2];
    for (int i = 0; i < N; i++) {
        same += !memcmp(out[i][0], out[i][1], sizeof out[0][0]);
        for (int mode = 0; mode < 2; mode++) {
            int c = 0;
            while (c < n_cells && memcmp(cell[c], out[i][mode], sizeof cell[0])) c++;
            if (c == n_cells) {
                memcpy(cell[n_cells], out[i][mode], sizeof cell[0]);
                cnt[n_cells][0] = cnt[n_cells][1] = 0;
                n_cells++;
            }
            cnt[c][mode]++;
        }
    }
    double chi2 = 0;
    for (int c = 0; c < n_cells; c++) {
        double a = cnt[c][0], b = cnt[c][1];
        chi2 += (a - b) * (a - b) / (a + b); /* equal sample sizes */
    }
    print_message("%d cells, chi2 %.1f, %d of %d seeds identical\n", n_cells, chi2, same, N);
    /* df = n_cells - 1 <= 26: the 0.999 quantile of chi2(26) is 54.1 */
    assert_true(n_cells <= 27);
    assert_true(chi2 < 54.1);
    assert_true(same >= N * 95 / 100);
    free(out);
    model_drafts_close(&md);
}

/* A sampled row is drawn where its logits are (ds_seq_batch.draws) unless logprobs are wanted,
 * when it comes back whole and ds_sample_token samples it here. The two routes must give the same
 * tokens seed for seed: the draws carry each row's uniform (the RNG peeked, then moved as rows
 * are taken), its penalties over the tokens before it — in a verify, the drafts of the rows
 * above too (a step that left them out fails here) — and the stops masked until min_tokens, row
 * by row in a verify that crosses it (a mask one row off fails the nearly greedy cases). Each
 * request runs alone, so both routes see the same forwards and the same logits. */
static void test_drawn_equals_host_sampled(void **state) {
    (void)state;
    /* seeds [0, SHARP) sampled, [SHARP, SEEDS) nearly greedy (below) */
    enum { NP = 16, MT = 40, SEEDS = DS_TEST_SANITIZED ? 6 : 12, SHARP = SEEDS * 2 / 3 };
    int32_t prompt[NP];
    h_prompt(prompt, NP, 71);
    model_drafts md;
    model_drafts_open(&md);
    uint64_t accepted = 0;
    int stopped = 0, sharp_stopped = 0;
    for (int spec = 0; spec < 2; spec++) {
        ds_engine *e =
            spec ? start_engine_spec(4, 256, 32u << 20, DS_SPEC_DSPARK, 3, greedy_drafts, &md)
                 : start_engine(4, 256, 32u << 20);
        for (int seed = 0; seed < SEEDS; seed++) {
            /* pass 0 finds likely tokens (no stops); passes 1 and 2 are the two routes with
             * 16 of them as stop ids, masked until min_tokens (the mask moves every draw's
             * boundaries, sampled or not): a verify crossing min_tokens masks row by row. From
             * seed SHARP on, nearly greedy (T 0.05, no penalties) with the tokens from
             * min_tokens on as the stops: a verify's rows past min_tokens then hold a stop that
             * is almost surely drawn — unless that row is masked as if before min_tokens */
            const int sharp = seed >= SHARP, min_tokens = 10 + seed % SHARP;
            h_req c[3];
            for (int pass = 0; pass < 3; pass++) {
                int route = pass == 2;
                ds_request_spec rs = {0};
                rs.prompt = prompt;
                rs.n_prompt = NP;
                ds_request_params_default(&rs.params);
                rs.params.sample.temperature = sharp ? 0.05f : 0.3f;
                rs.params.sample.top_p = seed % 2 ? 0.9f : 1.0f;
                rs.params.sample.min_p = seed == 4 ? 0.02f : 0.0f;
                rs.params.sample.presence_penalty = sharp ? 0.0f : 0.6f;
                rs.params.sample.frequency_penalty = sharp ? 0.0f : 0.4f;
                rs.params.min_tokens = min_tokens;
                rs.params.ignore_eos = 1;
                const int first_stop = sharp ? min_tokens : 8;
                for (int j = 0; pass && j < DS_MAX_STOP && first_stop + j < c[0].n[0]; j++)
                    rs.params.stop_token_ids[rs.params.n_stop_token_ids++] =
                        c[0].tokens[0][first_stop + j];
                rs.params.max_tokens = MT;
                rs.params.logprobs = route ? 0 : -1; /* 0: wanted, so the row comes back */
                rs.params.has_seed = 1;
                rs.params.seed = 500 + (uint64_t)seed;
                h_submit_spec(e, &rs, &c[pass]);
                h_wait(&c[pass]);
            }
            if (c[1].n[0] != c[2].n[0] ||
                memcmp(c[1].tokens[0], c[2].tokens[0], (size_t)c[1].n[0] * sizeof(int32_t)))
                fail_msg("spec %d seed %d: drawn and host-sampled tokens differ", spec, seed);
            assert_true(c[1].n[0] >= min_tokens); /* min_tokens held the stops back */
            stopped += c[1].n[0] < MT;
            sharp_stopped += sharp && c[1].n[0] < MT;
        }
        if (spec) {
            ds_engine_stats st;
            ds_engine_get_stats(e, &st);
            accepted = st.spec_accepted_tokens;
        }
        h_stop(e);
    }
    print_message("drafts accepted: %llu, %d of %d runs stopped\n", (unsigned long long)accepted,
                  stopped, 2 * SEEDS);
    assert_true(accepted > 0);      /* rows below an accepted draft were drawn */
    assert_true(sharp_stopped > 0); /* the sharp cases did reach their stops */
    model_drafts_close(&md);
}

/* A prompt that cannot fit the context is refused at submit, naming both lengths. */
static void test_too_long(void **state) {
    (void)state;
    ds_engine *e = start_engine(4, 64, 400u << 10);
    int L = ds_engine_max_model_len(e);
    int32_t *p = calloc((size_t)L + 5, sizeof(int32_t));
    ds_request_spec spec = {0};
    spec.prompt = p;
    spec.n_prompt = L + 5;
    ds_request_params_default(&spec.params);
    spec.on_event = h_on_event;
    h_req c;
    h_req_init(&c, 1);
    spec.user = &c;
    int why;
    ds_err err = {{0}};
    assert_true(ds_engine_submit(e, &spec, &why, &err) < 0);
    assert_int_equal(why, DS_SUBMIT_INVALID);
    char want[64];
    snprintf(want, sizeof want, "%d", L);
    assert_non_null(strstr(err.msg, want));
    free(p);
    h_stop(e);
}

static int held(void *ctx) {
    return __atomic_load_n((const int *)ctx, __ATOMIC_ACQUIRE);
}

static uint64_t stalls(ds_engine *e) {
    ds_engine_stats st;
    ds_engine_get_stats(e, &st);
    return st.stalls_total;
}

/* A step loop that can plan nothing while a request waits (the test's hold stands in for a
 * scheduling fault) reports the stall once after stall_seconds, counts it, and once steps can be
 * planned again the request ends as it would have. */
static void test_stall_reported_then_recovered(void **state) {
    (void)state;
    int32_t prompt[20], want[12];
    for (int i = 0; i < 20; i++) prompt[i] = 3 + 7 * i;
    ds_engine *ref = start_engine(4, 64, 400u << 10);
    h_run(ref, prompt, 20, 12, want);
    assert_int_equal(stalls(ref), 0);
    h_stop(ref);

    int hold = 1;
    ds_engine_opts o;
    engine_opts(&o, 4, 64, 400u << 10);
    o.test.hold = held;
    o.test.hold_ctx = &hold;
    o.test.stall_seconds = 0.2;
    ds_engine *e = h_start(&o);
    h_req *c = malloc(sizeof *c);
    h_submit(e, prompt, 20, 12, c);
    double t0 = ds_now();
    while (stalls(e) == 0 && ds_now() - t0 < 10.0) {
        const struct timespec ms = {0, 10000000};
        nanosleep(&ms, NULL);
    }
    assert_int_equal(stalls(e), 1);
    assert_true(ds_now() - t0 >= 0.2);
    const struct timespec wait = {0, 300000000}; /* still held: reported once, no token */
    nanosleep(&wait, NULL);
    assert_int_equal(stalls(e), 1);
    pthread_mutex_lock(&c->mu);
    assert_int_equal(c->n_seen[0], 0);
    pthread_mutex_unlock(&c->mu);
    __atomic_store_n(&hold, 0, __ATOMIC_RELEASE);
    h_wait(c);
    assert_int_equal(c->why[0], DS_FINISH_LENGTH);
    assert_int_equal(c->n[0], 12);
    assert_memory_equal(c->tokens[0], want, sizeof want);
    assert_int_equal(stalls(e), 1);
    free(c);
    h_stop(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stall_reported_then_recovered),
        cmocka_unit_test(test_greedy_matches_reference_in_batch),
        cmocka_unit_test(test_seeded_sampling),
        cmocka_unit_test(test_greedy_min_tokens),
        cmocka_unit_test(test_drawn_equals_host_sampled),
        cmocka_unit_test(test_pressure_and_abort),
        cmocka_unit_test(test_too_long),
        cmocka_unit_test(test_spec_greedy_equals_plain),
        cmocka_unit_test(test_spec_sampling_preserves_distribution),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
