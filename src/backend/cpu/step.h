/* step.h — the inside of the CPU backend's step, shared by its files: the per-model state
 * (scratch, host draws), the bump allocator over the scratch, the step itself, and the layer
 * forwards (layers.c) that forward.c's run_step calls in turn. */
#ifndef DS_BACKEND_CPU_STEP_H
#define DS_BACKEND_CPU_STEP_H

#include "backend/draw_host.h"
#include "model/backend.h"
#include "model/model_impl.h"

/* The CPU backend's state for one model (m->be_ctx). */
typedef struct cpu_ctx {
    float *scratch; /* [scratch_cap] floats, grown on demand: every buffer of a step */
    size_t scratch_cap;
    ds_host_draws draws; /* made at the first step that draws */
    char name[64];       /* "cpu (avx512)" */
} cpu_ctx;

/* A bump allocator over the step's scratch; reset at the start of every step. */
typedef struct scratch {
    float *buf; /* [cap] the context's scratch */
    size_t cap;
    size_t used;
    int overflow;
    size_t need;
} scratch;

/* n floats (64-byte aligned) of the scratch, or NULL with s->overflow set when it is short. */
static inline float *sc_take(scratch *s, size_t n) {
    n = (n + 15) & ~(size_t)15; /* keep 64-byte alignment */
    s->need += n;
    if (s->overflow || s->used + n > s->cap) {
        s->overflow = 1;
        return NULL;
    }
    float *p = s->buf + s->used;
    s->used += n;
    return p;
}

typedef struct step {
    ds_model *m;
    cpu_ctx *ctx;
    const ds_step_plan *plan; /* the step's decisions (model.c) */
    ds_kv_pool *pool;
    ds_seq_batch *seqs;
    int n_seq;
    int T;                 /* total tokens */
    const int *off;        /* [n_seq] first row of each segment */
    const ds_stage_io *in; /* from the previous pipeline stage, or NULL on the first */
    ds_stage_io *out;      /* to the next stage, or NULL on the last */
    scratch sc;
    int tp_failed; /* an all-reduce failed during this step */
} step;

/* Sums a row-parallel partial output over the TP group (nothing to do on one rank). After a
 * failure the step still runs to its end — with wrong numbers — and then reports it: the comm is
 * broken and the caller ends the job. */
static inline void cpu_tp_sum(step *s, float *buf, size_t n) {
    const ds_model *m = s->m;
    if (m->tp_size == 1 || s->tp_failed) return;
    if (m->opts.allreduce(m->opts.allreduce_ctx, buf, n)) s->tp_failed = 1;
}

/* The layers' token mixers and feed-forward blocks (layers.c): out[T][D] from the normed input
 * xn[T][D] of every token of the step. */
void cpu_kda_forward(step *s, const layer_w *lw, const float *xn, float *out);
/* (writes this step's latent rows into the pool) */
void cpu_mla_forward(step *s, const layer_w *lw, const float *xn, float *out);
void cpu_ffn_forward(step *s, const layer_w *lw, const float *xn, float *out);

#endif
