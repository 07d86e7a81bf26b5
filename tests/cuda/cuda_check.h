/* cuda_check.h — the harness every test_cuda_<op>.c uses (cuda_check.c): random inputs from one
 * seeded stream, device buffers, the error measure and the report, timing; and the checks and
 * timings each op file registers, which cuda_check.c's main runs in a fixed order. */
#ifndef DS_CUDA_CHECK_H
#define DS_CUDA_CHECK_H

#include "kernels/cpu/kernels.h"
#include "kernels/cuda/cuda_kernels.h"
#include "backend/cuda/cuda.h"
#include "sample/sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern int g_fail;   /* set by report when a check fails: the exit status */
extern ds_rng g_rng; /* every random input, seeded once by main */

#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        exit(2);                                                                                   \
    } while (0)

float urand(float lo, float hi);
float *rand_f32(size_t n, float lo, float hi);     /* [n] uniform in [lo, hi) */
uint16_t *rand_bf16(size_t n, float lo, float hi); /* [n] BF16, uniform in [lo, hi) */
/* a device buffer of `bytes`, holding host's bytes if host is given */
void *dev(ds_cu *c, const void *host, size_t bytes);
/* NaN bytes: a kernel that skips an element leaves a NaN, which every check rejects. */
void poison(ds_cu *c, void *d, size_t bytes);
void fetch(ds_cu *c, void *host, const void *d, size_t bytes); /* after a sync */
/* ||a - b|| / ||b|| over n, rows of `cols` at stride ld (ld = cols: packed); NaN anywhere: inf. */
double rel_err(const float *a, const float *b, size_t rows, size_t cols, size_t ld);
void report(const char *what, double err, double tol);
/* Each sequence's rows of state (n per sequence, `row` floats each, packed from off[z] rows in)
 * against the CPU's, for the sequences with keep[z]: the rollback rows of a verify. */
void report_seq_rows(const char *what, const float *got, const float *ref, const int *off,
                     const int *lens, const int *keep, int n_seq, size_t row, double tol);
/* Bits that differ between two device results of n floats (words compared, NaN bytes too). */
size_t words_differ(const float *a, const float *b, size_t n);
/* Sequences z < n_seq of lens[z] tokens from position pos0[z] laid out for the batched absorbed
 * MLA: z's block table starts at page bt_off[z] (pages of bs rows), token t's table and position
 * are tok_bt[t], tok_pos[t]; *T the tokens, *max_ctx the longest context; returns the pages, and
 * in *tables (malloc'd, [pages]) a scrambled permutation of them. */
int mla_batch_layout(const int *lens, const int *pos0, int n_seq, int bs, int *bt_off, int *tok_bt,
                     int *tok_pos, int *T, int *max_ctx, int32_t **tables);

typedef void (*run_fn)(ds_cu *c, void *ctx);
/* Median milliseconds of `reps` runs after `warm` warm-ups, each timed with events. */
double median_ms(ds_cu *c, run_fn f, void *ctx, int warm, int reps);

/* The ceilings the timings are reported against (measured first by --bench). */
typedef struct cuda_ceilings {
    double copy_gbs; /* device-to-device copy, GB/s read + written */
    double gemm_tf;  /* cuBLAS BF16 GEMM 8192^3, TFLOP/s */
} cuda_ceilings;

/* Each op file's checks (cuda_check.c runs them in its table's order). */
void checks_matmul(ds_cu *c);     /* test_cuda_matmul.c */
void checks_embed(ds_cu *c);      /* test_cuda_elementwise.c */
void checks_act(ds_cu *c);        /* ... */
void checks_copy(ds_cu *c);       /* ... */
void checks_norm_rows(ds_cu *c);  /* test_cuda_norm.c */
void checks_norm_heads(ds_cu *c); /* ... */
void checks_kda(ds_cu *c);        /* test_cuda_kda.c */
void checks_kda_inputs(ds_cu *c); /* ... */
void checks_kda_batch(ds_cu *c);  /* ... */
void checks_attnres(ds_cu *c);    /* test_cuda_attnres.c */
void checks_mla(ds_cu *c);        /* test_cuda_mla.c */
void checks_mla_batch(ds_cu *c);  /* ... */
void checks_moe(ds_cu *c);        /* test_cuda_moe.c */
void checks_rope(ds_cu *c);       /* test_cuda_rope.c */
void checks_argmax(ds_cu *c);     /* test_cuda_sample.c */
void checks_draws(ds_cu *c);      /* ... */
void checks_matmul_fp8(ds_cu *c); /* test_cuda_matmul_fp8.c */
void checks_moe_mxfp4(ds_cu *c);  /* test_cuda_moe_mxfp4.c */
void checks_kv_rows(ds_cu *c);    /* test_cuda_kv_rows.c */
void checks_moe_fp8(ds_cu *c);    /* test_cuda_moe_fp8.c */
void checks_nccl(ds_cu *c);       /* test_cuda_nccl.c */

/* Each op file's timings (--bench sections: matmul, kda, mla, moe, draw, fp8, mxfp4, moefp8). */
void bench_matmul(ds_cu *c, const cuda_ceilings *ceil);
void bench_kda(ds_cu *c, const cuda_ceilings *ceil);
void bench_mla_expanded(ds_cu *c, const cuda_ceilings *ceil);
void bench_mla_absorbed(ds_cu *c, const cuda_ceilings *ceil);
void bench_moe(ds_cu *c, const cuda_ceilings *ceil);
void bench_draw(ds_cu *c, const cuda_ceilings *ceil);
void bench_matmul_fp8(ds_cu *c, const cuda_ceilings *ceil);
void bench_moe_mxfp4(ds_cu *c, const cuda_ceilings *ceil);
void bench_moe_fp8(ds_cu *c, const cuda_ceilings *ceil);

/* --kda-io DIR T H D (test_cuda_kda.c) */
void kda_io(ds_cu *c, const char *dir, int T, int H, int D);

#endif
