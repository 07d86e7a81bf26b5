/* internal.h — the inside of the CUDA backend, shared by its files: the process's GPU and the
 * memory handle it gives out (attach.c), a model's weights on the device (upload.c), its
 * per-step buffers and the step itself (step.c), the layers (layers.c), the draws (draw.c) and
 * the DSpark draft's device path (draft.c). Nothing outside src/backend/cuda includes this. */
#ifndef DS_BACKEND_CUDA_INTERNAL_H
#define DS_BACKEND_CUDA_INTERNAL_H

#include "backend/cuda/cuda.h"
#include "backend/cuda/tuning.h"
#include "backend/draw_host.h"
#include "base/devmem.h"
#include "kernels/cuda/cuda_kernels.h"
#include "model/backend.h"
#include "model/draft_impl.h"
#include "model/model_impl.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the device ----------------------------------------------------------------------------
 * One GPU per process (a job runs one rank per GPU); every model attached in the process shares
 * it and its stream, so a state copy made by the engine is ordered with the steps around it. A
 * later attach finds it in attach.c's registry; each model gives out its memory handle
 * (ds_model_dmem), whose operations take the device as their context. */
typedef struct cuda_device {
    ds_cu *c;
    int refs;                      /* models attached to it */
    int index;                     /* which GPU */
    ds_dmem dmem;                  /* base/devmem.h's handle: attach.c's operations, ctx = this */
    char copy_err[sizeof(ds_err)]; /* the first failed state copy, reported by the next step */
} cuda_device;

/* ---- weights on the device ------------------------------------------------------------------ */

typedef struct cu_kda {
    /* [3P + nf + Hk][D]: every projection of the layer's input stacked — q, k, v, f_a (and g_a,
     * with the low-rank gate: nf = 2 dk, else dk) and b — so that a decode step streams them in
     * one launch instead of three (bits unchanged: each output row is its own dot product) */
    ds_cu_mat in;
    ds_cu_mat in_runs[6]; /* in's runs when its members differ in dtype (ptpc: b_proj BF16) */
    int nf;
    ds_cu_mat f_b, g, g_b, o;
    float *conv;                     /* [3][P][W]: q, k and v short-conv weights */
    float *dt_bias, *A_log, *o_norm; /* [P], [Hk], [dk] */
} cu_kda;

typedef struct cu_mla {
    ds_cu_mat q, q_a, q_b, kv_a, kv_b, o, g;
    ds_cu_mat ukT; /* [Ha][R][dn]: W_UK_h^T per head, q̄_h = ukT_h qN_h as a matmul */
    float *q_a_norm, *kv_a_norm; /* [Rq], [R] */
} cu_mla;

typedef struct cu_ffn {
    ds_cu_mat gu, down;       /* dense MLP: [2I][D] gate and up stacked, [D][I] */
    ds_cu_mat sh_gu, sh_down; /* shared experts likewise */
    ds_cu_mat router, lat_down, lat_up;
    float *router_bias, *lat_norm;       /* [E] or NULL, [Hin] or NULL */
    ds_cu_mat gu_runs[2], sh_gu_runs[2]; /* gu's and sh_gu's runs when gate and up differ */
    uint16_t *gate_up; /* [E][2 Ie][Hin] BF16: an expert's gate rows, then its up rows */
    uint16_t *e_down;  /* [E][Hin][Ie] BF16 */
    /* MXFP4 routed experts (experts_mxfp4; gate_up and e_down NULL), kept packed:
     * codes [E][2 Ie][Hin/2] and scales [E][2 Ie][Hin/32]; down [E][Hin][Ie/2], [E][Hin][Ie/32] */
    int experts_mxfp4;
    /* ptpc FP8 routed experts (experts_fp8; gate_up and e_down NULL): codes [E][2 Ie][Hin] and
     * f32 row scales [E][2 Ie] (held in gu_scales), down [E][Hin][Ie] and [E][Hin] */
    int experts_fp8;
    uint8_t *gu_codes, *gu_scales, *dn_codes, *dn_scales;
} cu_ffn;

typedef struct cu_layer {
    float *in_norm, *post_norm, *attn_res_np, *mlp_res_np; /* [D] */
    cu_kda kda;
    cu_mla mla;
    cu_ffn ffn;
} cu_layer;

/* The CUDA backend's state for one model (m->be_ctx). */
typedef struct ds_cuda_model {
    cuda_device *dev;    /* the process's GPU, shared by every model attached to it */
    ds_cu *c;            /* dev->c */
    ds_cuda_tuning tune; /* the switches, read at attach */
    cu_layer *layers;    /* [L]; [l0, l1) uploaded */
    ds_cu_mat embed, lm_head;
    float *final_norm, *out_res_np;
    void **allocs; /* every device allocation of the weights */
    int n_allocs, cap_allocs;
    size_t weight_bytes;
    const ds_model *m; /* the model these are the weights of */
    uint16_t *conv;    /* host staging for dtype conversion, conv_cap elements */
    size_t conv_cap;
    /* per-step buffers, grown on demand */
    float *sc; /* device scratch, sc_cap floats */
    size_t sc_cap;
    int32_t *iarena; /* device int32 indices, icap */
    size_t icap;
    void **parena; /* device pointer tables, pcap */
    size_t pcap;
    float *stage; /* device copies of state a caller kept in host memory, stage_cap floats */
    size_t stage_cap;
    uint64_t own_epoch; /* bumped when sc, the arenas or stage move (graphs point into them) */
    uint64_t graph_epoch;
    struct cu_graph_entry {
        struct graph_key {
            int n_seq, T, n_lg, any_rows, ctx_cap, nb_in;
        } key;
        ds_cu_graph *g; /* NULL: capture failed, run this shape eagerly */
    } graphs[64];
    int n_graphs;
    uint64_t graph_replays, graph_failures;
    /* DS_CUDA_STEP_TIMES: decode steps' host time (the whole forward call) and device time (the
     * first upload to the last kernel), summed and least, reported at detach */
    struct {
        long n;
        double host_s, dev_ms, host_min_s, dev_min_ms;
    } st;
    float *tp_host; /* tensor parallelism: collectives staged through the host, tp_cap floats */
    size_t tp_cap;
    /* a step's draws (draw_rows): per logits row its draw and token ([n_lg] each, NULL: not
     * drawn), and for the device the draws' numbers, edits and tokens; *_cap elements each */
    const ds_row_draw **draw_d;
    int32_t **draw_out;
    ds_cu_draw *draw_cu;
    int32_t *draw_ed, *draw_tok;
    size_t draw_d_cap, draw_out_cap, draw_cu_cap, draw_ed_cap, draw_tok_cap;
    int32_t *h_i; /* host staging of the two arenas */
    size_t h_icap;
    void **h_p;
    size_t h_pcap;
    int *h_kda; /* [2][n_seq] chunked KDA's segment starts and lengths, h_kda_cap ints */
    size_t h_kda_cap;
    void *nccl; /* ds_nccl *: the TP group's sums on the GPUs, or NULL (through the host) */
    ds_host_draws draws; /* a TP group's draws, on the host (draw.c) */
} ds_cuda_model;

/* ---- one step ---------------------------------------------------------------------------------
 */

typedef struct cstep {
    ds_model *m;
    ds_cuda_model *cm;
    ds_cu *c;
    const ds_step_plan *plan; /* the step's decisions (model.c) */
    ds_kv_pool *pool;
    ds_seq_batch *seqs;
    int n_seq, T;
    const int *off; /* [n_seq] first row of each segment */
    size_t used;    /* scratch floats taken */
    int overflow;   /* a take did not fit: the estimate is short (a bug); nothing was launched */
    /* device views into the index arenas */
    const int32_t *ids;      /* [T] */
    const int32_t *seg_off;  /* [n_seq + 1] */
    const int32_t *lat_dst;  /* [T] pool row of each token's latent */
    const int32_t *bt;       /* block tables, sequence q's at bt + bt_off[q] */
    const int32_t *ctx_rows; /* pool rows of an expanded segment's context, q's at ctx_off[q] */
    const int32_t *lg_rows;  /* [n_lg] rows of x that want logits */
    const int32_t *tok_bt;   /* [T] where each token's block table starts in bt */
    const int32_t *tok_pos;  /* [T] each token's position in its sequence */
    int *bt_off, *ctx_off;   /* [n_seq] host */
    int n_lg;
    int any_rows;              /* some segment keeps verify state rows */
    float *const *S;           /* [n_kda][n_seq] recurrent state of each KDA layer, per sequence */
    float *const *S_rows;      /* [n_kda][n_seq] its verify rows, or NULL entries */
    float *const *tails;       /* [n_kda][n_seq] short-conv tails (q's; k's and v's follow) */
    float *const *tail_rows;   /* [n_kda][n_seq] their verify rows, or NULL entries */
    const float *const *cands; /* [nb_max + 1][nb_max + 1] AttnRes candidate lists */
    int nb_max;
    int ctx_cap; /* absorbed attention's context bound: a power of two >= every context */
    float *P, *x, *a, *bank, *xr, *lg; /* the step's long-lived buffers (run_step) */
    uint64_t *am; /* [n_lg][am_parts] keys of the greedy token of each row of lg (in parts) */
    int am_parts;
} cstep;

/* Opens a profiled interval (DS_CUDA_PROFILE=1; see ds_cu_prof_mark). */
#define PROF(s, label) ds_cu_prof_mark((s)->c, label)

static inline float *take(cstep *s, size_t n) {
    n = (n + 15) & ~(size_t)15; /* 64-byte alignment for the vector loads */
    if (s->overflow || s->used + n > s->cm->sc_cap) {
        s->overflow = 1;
        return s->cm->sc; /* unused: every caller checks TAKEN before launching */
    }
    float *p = s->cm->sc + s->used;
    s->used += n;
    return p;
}

/* After a group of takes: a short scratch estimate is reported, never written past. */
#define TAKEN()                                                                                    \
    do {                                                                                           \
        if (s->overflow)                                                                           \
            return ds_errf(err,                                                                    \
                           "forward: internal error: the cuda scratch estimate (%zu floats) "      \
                           "is short",                                                             \
                           s->cm->sc_cap);                                                         \
    } while (0)

#define TRY(x)                                                                                     \
    do {                                                                                           \
        if (x) return DS_ERR;                                                                      \
    } while (0)

/* ---- between the files -------------------------------------------------------------------- */

/* upload.c: w into device memory (out zero for an empty w), v [n] likewise (NULL for none); the
 * allocations are the model's, freed at detach. */
int cuda_up_mat(ds_cuda_model *cm, const ds_mat *w, ds_cu_mat *out, ds_err *err);
int cuda_up_vec(ds_cuda_model *cm, const float *v, size_t n, float **out, ds_err *err);
/* an MLA layer's weights (m: its heads and shapes), with W_UK transposed per head */
int cuda_up_mla(ds_cuda_model *cm, const ds_model *m, const mla_w *w, cu_mla *d, ds_err *err);
/* every bound weight of m: the ends and the layers [l0, l1) */
int cuda_upload_weights(ds_cuda_model *cm, const ds_model *m, ds_err *err);

/* step.c: grows a device buffer (contents not kept), with room for the next, slightly larger
 * need; a host buffer to need elements (contents kept) */
int cuda_grow_dev(ds_cu *c, void **p, size_t *cap, size_t need, size_t elem, ds_err *err);
int cuda_grow_host(void **p, size_t *cap, size_t need, size_t elem, ds_err *err);
/* one decode step's times into cm->st (DS_CUDA_STEP_TIMES; dev_ms < 0: not had) */
void cuda_step_times_add(ds_cuda_model *cm, double host_s, double dev_ms);
/* dbuf[n] (device) <- its sum over the TP group; nothing on one rank */
int cuda_tp_sum(cstep *s, float *dbuf, size_t n, ds_err *err);
/* the graphs captured for cm's steps, freed */
void cuda_drop_graphs(ds_cuda_model *cm);
int cuda_forward(ds_model *m, const ds_step_plan *plan, ds_kv_pool *pool, ds_seq_batch *seqs_in,
                 int n_seq, const ds_stage_io *in, ds_stage_io *out, ds_err *err);

/* layers.c: a layer's token mixer and feed-forward block, out[T][D] from xn[T][D] */
int cuda_kda_forward(cstep *s, const layer_w *lw, const cu_kda *w, const float *xn, float *out,
                     ds_err *err);
int cuda_mla_forward(cstep *s, const layer_w *lw, const cu_mla *w, const float *xn, float *out,
                     ds_err *err);
int cuda_ffn_forward(cstep *s, const cu_ffn *w, int is_moe, const float *xn, float *out,
                     ds_err *err);
/* Does this model's KDA shape fit ds_cu_kda_decode_fused (see kda_fused)? */
int cuda_kda_fuse_fits(const ds_model *m, const ds_cuda_model *cm, const cu_kda *w);
/* segments of the step whose KDA runs in chunks */
int cuda_kda_chunked_segments(const cstep *s);
/* Context rows an expanded MLA segment of n queries and ctx rows of context expands at a time:
 * ctx, or the device's block (ds_cu_mla_ctx_block) where the context is longer and the fused
 * kernel merges blocks (ds_cu_mla_lse_ok). The scratch estimate and the forward both ask. */
static inline int cuda_mla_ctx_rows(const ds_cu *c, int n, int ctx, int dn, int dr, int dvh) {
    const int cb = ds_cu_mla_ctx_block(c);
    return cb > 0 && ctx > cb && ds_cu_mla_lse_ok(c, n, dn, dr, dvh) ? cb : ctx;
}

/* draw.c: the step's drawn rows, from a TP group's gathered rows all [Tp][n_lg][vp] on the host,
 * or on one GPU where the logits are */
int cuda_draw_gathered(cstep *s, const float *all, ds_err *err);
int cuda_draw_on_device(cstep *s, ds_err *err);

/* draft.c: the draft's device path (model/backend.h's draft_* entries) */
int cuda_draft_create(ds_draft *d, const ds_model *target, ds_err *err);
void cuda_draft_free(ds_draft *d);
int cuda_draft_write_context(ds_draft *d, ds_draft_cache *c, int n_items,
                             const ds_draft_ctx_write *w, ds_err *err);
int cuda_draft_propose(ds_draft *d, ds_draft_cache *c, int n, const int32_t *const *block_tables,
                       const int *ps, const int32_t *anchors, int T, int32_t *drafts,
                       float *block_logits, ds_err *err);

#endif
