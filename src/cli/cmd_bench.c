/* cmd_bench.c — `deltaserve bench --model DIR`: prompt and decode throughput of the forward pass,
 * each reported against this machine's limits measured in the same run (a read-bandwidth loop and
 * an FMA loop), so every figure says how far it is from the hardware. */
#include "cli/args.h"
#include "cli/bench_limits.h"
#include "cli/commands.h"
#include "model/model.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BENCH_BLOCK = 64 };

typedef struct bench_result {
    double prompt_tps, prompt_gflops;
    int n_batches;
    int batch[8];
    double decode_tps[8], decode_gbs[8], decode_gflops[8];
} bench_result;

/* Decode `steps` tokens for each of B sequences (after a short prompt each), one batched
 * forward per step; returns seconds per step (best of the steps after the first). */
static int run_decode(ds_model *m, int B, int prompt, int steps, double *sec_per_step,
                      ds_err *err) {
    const ds_config *c = ds_model_config(m);
    int ctx = prompt + steps + 1, pages_per = (ctx + BENCH_BLOCK - 1) / BENCH_BLOCK;
    ds_kv_pool pool;
    if (ds_kv_pool_init(&pool, m, B * pages_per, BENCH_BLOCK, err)) return DS_ERR;
    int rc = DS_ERR;
    size_t slot_n = ds_model_slot_floats(m);
    float *slots = ds_calloc((size_t)B * slot_n, sizeof(float), err);         /* [B][slot] */
    int32_t *table = ds_malloc((size_t)B * pages_per * sizeof(int32_t), err); /* [B][pages] */
    int32_t *ids = ds_malloc((size_t)B * ctx * sizeof(int32_t), err);         /* [B][ctx] */
    ds_seq_batch *sb = ds_calloc((size_t)B, sizeof *sb, err);
    float *logits = ds_malloc((size_t)B * c->vocab_size * sizeof(float), err); /* [B][V] */
    if (!slots || !table || !ids || !sb || !logits) goto out;
    for (int i = 0; i < B * pages_per; i++) table[i] = i;
    ds_rng rng;
    ds_rng_seed(&rng, 1);
    for (int i = 0; i < B * ctx; i++) ids[i] = (int32_t)(ds_rng_next(&rng) % 256);
    for (int b = 0; b < B; b++) {
        sb[b] = (ds_seq_batch){.tokens = ids + (size_t)b * ctx,
                               .n = prompt,
                               .slot = slots + (size_t)b * slot_n,
                               .block_table = table + (size_t)b * pages_per};
    }
    if (ds_model_forward(m, &pool, sb, B, err)) goto out;
    double best = 1e30;
    for (int s = 0; s < steps; s++) {
        for (int b = 0; b < B; b++) {
            sb[b].tokens = ids + (size_t)b * ctx + prompt + s;
            sb[b].n = 1;
            sb[b].pos0 = prompt + s;
            sb[b].logits = logits + (size_t)b * c->vocab_size;
            sb[b].n_logits = 1;
        }
        double t0 = ds_now();
        if (ds_model_forward(m, &pool, sb, B, err)) goto out;
        double dt = ds_now() - t0;
        if (s > 0 && dt < best) best = dt;
    }
    *sec_per_step = best;
    rc = DS_OK;
out:
    free(slots);
    free(table);
    free(ids);
    free(sb);
    free(logits);
    ds_kv_pool_free(&pool);
    return rc;
}

static int run_prompt(ds_model *m, int T, int reps, double *sec, ds_err *err) {
    const ds_config *c = ds_model_config(m);
    int pages = (T + BENCH_BLOCK - 1) / BENCH_BLOCK;
    ds_kv_pool pool;
    if (ds_kv_pool_init(&pool, m, pages, BENCH_BLOCK, err)) return DS_ERR;
    int rc = DS_ERR;
    float *slot = ds_calloc(ds_model_slot_floats(m), sizeof(float), err);
    int32_t *table = ds_malloc((size_t)pages * sizeof(int32_t), err);
    int32_t *ids = ds_malloc((size_t)T * sizeof(int32_t), err);
    float *logits = ds_malloc((size_t)c->vocab_size * sizeof(float), err);
    if (!slot || !table || !ids || !logits) goto out;
    for (int i = 0; i < pages; i++) table[i] = i;
    ds_rng rng;
    ds_rng_seed(&rng, 2);
    for (int i = 0; i < T; i++) ids[i] = (int32_t)(ds_rng_next(&rng) % 256);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        memset(slot, 0, ds_model_slot_floats(m) * sizeof(float));
        ds_seq_batch sb = {ids, T, 0, slot, table, logits, 1, NULL, NULL, NULL, 0, NULL, NULL};
        double t0 = ds_now();
        if (ds_model_forward(m, &pool, &sb, 1, err)) goto out;
        double dt = ds_now() - t0;
        if (dt < best) best = dt;
    }
    *sec = best;
    rc = DS_OK;
out:
    free(slot);
    free(table);
    free(ids);
    free(logits);
    ds_kv_pool_free(&pool);
    return rc;
}

int ds_cmd_bench(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "serve")) return ds_cmd_bench_serve(argc - 1, argv + 1);
    const char *model_dir = NULL, *json_path = NULL;
    int prompt_tokens = 512, steps = 8, reps = 2;
    ds_arg opts[] = {
        {"model", "m", DS_ARG_STRING, &model_dir, "DIR", "checkpoint folder", .required = 1},
        DS_OPT("prompt-tokens", NULL, DS_ARG_INT, &prompt_tokens, "N", "prompt length measured"),
        DS_OPT("decode-steps", NULL, DS_ARG_INT, &steps, "N", "decode steps per batch size"),
        DS_OPT("reps", NULL, DS_ARG_INT, &reps, "N", "prompt repetitions (best is kept)"),
        DS_OPT("json", NULL, DS_ARG_STRING, &json_path, "FILE", "also write the results as JSON"),
    };
    ds_args a = {"deltaserve bench",
                 "Prompt tokens/s at --prompt-tokens and decode tokens/s at batch 1 and 16, with\n"
                 "achieved GB/s and GFLOP/s as fractions of this machine's read bandwidth and FMA\n"
                 "peak, measured in the same run.\n"
                 "`deltaserve bench serve --help`: the load generator for a running server.",
                 opts, (int)DS_ARRAY_LEN(opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    if (prompt_tokens < 1 || steps < 2 || reps < 1) {
        fprintf(stderr, "bench: need --prompt-tokens >= 1, --decode-steps >= 2, --reps >= 1\n");
        return 2;
    }
    ds_err err = {{0}};
    ds_model *m = NULL;
    if (ds_model_load(model_dir, NULL, &m, &err)) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }
    int threads = omp_get_max_threads();
    double bw = ds_bench_read_bandwidth((size_t)1 << 30, threads);
    double peak = ds_bench_fma_peak(threads);
    bench_result r = {0};
    double sec;
    if (run_prompt(m, prompt_tokens, reps, &sec, &err)) goto fail;
    r.prompt_tps = prompt_tokens / sec;
    r.prompt_gflops = ds_model_token_flops(m, 0) * prompt_tokens / sec / 1e9;
    int batches[] = {1, 16};
    r.n_batches = 2;
    for (int i = 0; i < r.n_batches; i++) {
        int B = batches[i];
        r.batch[i] = B;
        if (run_decode(m, B, 32, steps, &sec, &err)) goto fail;
        r.decode_tps[i] = B / sec;
        /* batch 1 reads every active weight once per token; larger batches share the reads, so
         * only batch 1 is reported as bandwidth */
        r.decode_gbs[i] = B == 1 ? ds_model_decode_bytes(m) / sec / 1e9 : 0;
        r.decode_gflops[i] = ds_model_token_flops(m, 1) * B / sec / 1e9;
    }
    printf("deltaserve bench  model=%s  isa=%s  threads=%d  weights=%.2f GB\n", model_dir,
           ds_isa_name(ds_kernels_isa()), threads, ds_model_weight_bytes(m) / 1e9);
    printf("machine: read bandwidth %.2f GB/s, FMA peak %.1f GFLOP/s\n", bw, peak);
    printf("%-18s %12s %12s %10s %12s %10s\n", "case", "tokens/s", "GB/s", "of bw", "GFLOP/s",
           "of peak");
    printf("%-18s %12.1f %12s %10s %12.1f %9.1f%%\n", "prompt", r.prompt_tps, "-", "-",
           r.prompt_gflops, 100 * r.prompt_gflops / peak);
    for (int i = 0; i < r.n_batches; i++) {
        char name[32];
        snprintf(name, sizeof name, "decode batch %d", r.batch[i]);
        if (r.decode_gbs[i] > 0)
            printf("%-18s %12.1f %12.2f %9.1f%% %12.1f %9.1f%%\n", name, r.decode_tps[i],
                   r.decode_gbs[i], 100 * r.decode_gbs[i] / bw, r.decode_gflops[i],
                   100 * r.decode_gflops[i] / peak);
        else
            printf("%-18s %12.1f %12s %10s %12.1f %9.1f%%\n", name, r.decode_tps[i], "-", "-",
                   r.decode_gflops[i], 100 * r.decode_gflops[i] / peak);
    }
    if (json_path) {
        FILE *f = fopen(json_path, "w");
        if (!f) {
            ds_errf(&err, "%s: cannot write", json_path);
            goto fail;
        }
        fprintf(f,
                "{\"model\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"read_bw_gbs\": %.3f, "
                "\"fma_peak_gflops\": %.3f, \"prompt_tokens\": %d, \"prompt_tps\": %.3f, "
                "\"prompt_gflops\": %.3f, \"prompt_frac_peak\": %.4f, \"decode\": [",
                model_dir, ds_isa_name(ds_kernels_isa()), threads, bw, peak, prompt_tokens,
                r.prompt_tps, r.prompt_gflops, r.prompt_gflops / peak);
        for (int i = 0; i < r.n_batches; i++)
            fprintf(f,
                    "%s{\"batch\": %d, \"tps\": %.3f, \"gbs\": %.3f, \"frac_bw\": %.4f, "
                    "\"gflops\": %.3f}",
                    i ? ", " : "", r.batch[i], r.decode_tps[i], r.decode_gbs[i],
                    r.decode_gbs[i] / bw, r.decode_gflops[i]);
        fprintf(f, "]}\n");
        fclose(f);
    }
    ds_model_free(m);
    return 0;
fail:
    fprintf(stderr, "bench: %s\n", err.msg);
    ds_model_free(m);
    return 1;
}
