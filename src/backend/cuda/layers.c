/* layers.c — the CUDA backend's layers, each the CPU backend's (src/backend/cpu/layers.c) through
 * kernels/cuda: KDA (the stacked input projections, the gates on the side stream, the short convs
 * and the recurrence of every segment in one launch each, long segments in chunks, a decode
 * step's middle as one fused kernel), MLA (absorbed runs, expanded long segments) and the
 * feed-forward blocks (dense MLP, MoE with shared experts beside the routed ones). */
#include "backend/cuda/internal.h"
#include "kernels/shared/kv_row.h"

#include <math.h>

/* Does this model's KDA shape fit ds_cu_kda_decode_fused (see kda_fused)? */
int cuda_kda_fuse_fits(const ds_model *m, const ds_cuda_model *cm, const cu_kda *w) {
    const ds_config *c = &m->cfg;
    /* f_b and g_b both BF16 or both ptpc FP8 (read as such), each in one piece */
    const int f8 = w->f_b.dtype == DS_CU_FP8;
    return !c->use_full_rank_gate && (f8 || w->f_b.dtype == DS_CU_BF16) && !w->f_b.runs &&
           w->g_b.dtype == w->f_b.dtype && !w->g_b.runs &&
           ds_cu_kda_decode_fits(cm->c, c->kda_head_dim, c->short_conv_kernel_size, w->f_b.cols,
                                 w->g_b.cols, f8);
}

/* Does segment z run in chunks? The plan's choice (model.c: long enough, no verify rows), where
 * the GPU's chunked kernel has the head size. */
static int kda_chunk_eligible(const cstep *s, int z) {
    const ds_model *m = s->m;
    return s->plan->kda_chunked[z] &&
           ds_cu_kda_chunked_supports(m->cfg.kda_head_dim, m->cfg.kda_head_dim);
}
int cuda_kda_chunked_segments(const cstep *s) {
    int n = 0;
    for (int z = 0; z < s->n_seq; z++) n += kda_chunk_eligible(s, z);
    return n;
}

/* A decode step's KDA middle as one kernel (ds_cu_kda_decode_fused: the same bits as the seven
 * launches it replaces) when every sequence brings one token and keeps no rollback rows, up to
 * tune.kda_fused sequences (DS_CUDA_KDA_FUSED, default DS_CUDA_KDA_FUSE_MAX; 0: never). Each
 * cluster stages its head's f_b and g_b rows, which the batched matmuls read once for all
 * sequences: on the H200 at the 48B shape it made steps faster at batch 1 and 2 and slower at 4
 * and 8 (bench/RESULTS.md, session 14), hence the cap. */
static int kda_fused(const cstep *s, const cu_kda *w) {
    if (s->any_rows || s->n_seq > s->cm->tune.kda_fused || s->T != s->n_seq ||
        !cuda_kda_fuse_fits(s->m, s->cm, w))
        return 0;
    for (int z = 0; z < s->n_seq; z++)
        if (s->seqs[z].n != 1 || kda_chunk_eligible(s, z)) return 0;
    return 1;
}

/* The step's segments that run in chunks (ds_cu_kda_chunked), on states S + at; raw: their
 * inputs before the gate, beta and head norms (ds_cu_kda_chunked_raw; g holds f_b's outputs). */
static int kda_chunked_segments(cstep *s, float *o, const float *q, const float *k, const float *v,
                                const float *g, const float *beta, const ds_cu_kda_raw *raw,
                                size_t at, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    const int H = s->m->Hk, dk = s->m->cfg.kda_head_dim;
    if (cuda_grow_host((void **)&cm->h_kda, &cm->h_kda_cap, 2 * (size_t)s->n_seq, sizeof(int), err))
        return DS_ERR;
    int *start = cm->h_kda, *len = cm->h_kda + s->n_seq; /* length 0: not chunked */
    for (int z = 0; z < s->n_seq; z++) {
        start[z] = s->off[z];
        len[z] = kda_chunk_eligible(s, z) ? s->seqs[z].n : 0;
    }
    if (raw)
        return ds_cu_kda_chunked_raw(s->c, o, q, k, v, g, raw, start, len, s->S + at, s->n_seq, H,
                                     dk, dk, err);
    return ds_cu_kda_chunked(s->c, o, q, k, v, g, beta, start, len, s->S + at, s->n_seq, H, dk, dk,
                             err);
}

/* out[T][D] = KDA(xn) (cpu_kda_forward). */
int cuda_kda_forward(cstep *s, const layer_w *lw, const cu_kda *w, const float *xn, float *out,
                     ds_err *err) {
    const ds_config *c = &s->m->cfg;
    ds_cu *cu = s->c;
    int T = s->T, D = c->hidden_size, H = s->m->Hk, dk = c->kda_head_dim, P = H * dk;
    int W = c->short_conv_kernel_size, nf = w->nf, ld = 3 * P + nf + H;
    size_t mark = s->used;
    float *pre = take(s, (size_t)T * ld); /* [T][3P | nf | H]: q, k, v before the conv, f_a x
                                              (then g_a x), b x */
    float *q = take(s, (size_t)T * P);    /* [T][H][dk] */
    float *k = take(s, (size_t)T * P);    /* [T][H][dk] */
    float *v = take(s, (size_t)T * P);    /* [T][H][dv] */
    float *g = take(s, (size_t)T * P);    /* [T][H][dk] log decay */
    float *gt = take(s, (size_t)T * P);   /* [T][H][dv] the output gate */
    float *beta = take(s, (size_t)T * H); /* [T][H] */
    float *o = take(s, (size_t)T * P);    /* [T][H][dv] f_b's output, then the recurrence's */
    const float *fa = pre + 3 * P, *braw = fa + nf;
    TAKEN();
    size_t slot_n = ds_model_slot_floats(s->m), at = (size_t)lw->kind_idx * s->n_seq;
    /* q, k and v in one weight stream, then every segment's three convs in one launch, each on
     * its own tails (and, for a verify, the tails after each token) */
    PROF(s, "kda qkv");
    TRY(ds_cu_matmul(cu, pre, ld, xn, D, T, &w->in, err));
    int fused = kda_fused(s, w);
    if (fused) {
        PROF(s, "kda recurrence");
        const ds_cu_kda_decode kd = {
            .pre = pre,
            .ld = ld,
            .fa_off = 3 * P,
            .ga_off = 3 * P + dk, /* g_a x: fa's second half */
            .b_off = 3 * P + nf,
            .conv_w = w->conv,
            .tails = s->tails + at,
            .f_b = w->f_b.data,
            .g_b = w->g_b.data,
            .f_bs = w->f_b.dtype == DS_CU_FP8 ? (const float *)w->f_b.scale : NULL,
            .g_bs = w->g_b.dtype == DS_CU_FP8 ? (const float *)w->g_b.scale : NULL,
            .Kf = w->f_b.cols,
            .Kg = w->g_b.cols,
            .A_log = w->A_log,
            .dt_bias = w->dt_bias,
            .o_norm = w->o_norm,
            .lower_bound_form = c->has_gate_lower_bound,
            .lb = c->gate_lower_bound,
            .q_scale = 1.0f / sqrtf((float)dk),
            .eps = 1e-6f,
            .norm_eps = c->rms_norm_eps,
            .S = s->S + at,
            .y = q, /* o_proj's input, as the gated norm below writes */
            .n_seq = s->n_seq,
            .H = H,
            .dk = dk,
            .W = W};
        TRY(ds_cu_kda_decode_fused(cu, &kd, err));
    } else {
        /* Every segment in chunks (a prompt's step): the gate, beta and the head norms are made
         * inside chunked KDA's first pass (ds_cu_kda_chunked_raw), g keeping f_b's output */
        const int n_chunked = cuda_kda_chunked_segments(s);
        const int raw = s->cm->tune.kda_raw && n_chunked > 0 && n_chunked == s->n_seq;
        /* the decay gate and beta (from f_a x and b x), then the output gate, on the side
         * stream, beside the convs of q, k and v; joined before the recurrence */
        PROF(s, "kda gates, beta");
        TRY(ds_cu_side_begin(cu, err));
        int rc = ds_cu_matmul(cu, raw ? g : o, P, fa, ld, T, &w->f_b, err);
        if (!rc && !raw)
            ds_cu_kda_gate(cu, g, o, T, H, dk, w->A_log, w->dt_bias, c->has_gate_lower_bound,
                           c->gate_lower_bound, beta, braw, ld);
        if (!rc && c->use_full_rank_gate)
            rc = ds_cu_matmul(cu, gt, P, xn, D, T, &w->g, err);
        else if (!rc) /* g_a x sits in fa's second half */
            rc = ds_cu_matmul(cu, gt, P, fa + dk, ld, T, &w->g_b, err);
        TRY(ds_cu_side_end(cu, err));
        TRY(rc);
        PROF(s, "kda conv+l2norm");
        ds_cu_conv_batch cb = {3,
                               P,
                               W,
                               pre,
                               ld,
                               q,
                               (size_t)(k - q),
                               w->conv,
                               s->tails + at,
                               s->any_rows ? s->tail_rows + at : NULL,
                               slot_n,
                               s->seg_off,
                               s->n_seq,
                               T};
        if (v - k != k - q)
            return ds_errf(err, "forward: internal error: q, k, v not evenly spaced");
        TRY(ds_cu_short_conv_silu_batch(cu, &cb, err));
        const float q_scale = 1.0f / sqrtf((float)dk), eps = 1e-6f;
        if (!raw) ds_cu_l2norm_heads2(cu, q, q_scale, k, 1.0f, T, H, dk, eps);
        TRY(ds_cu_side_join(cu, err));
        /* every segment in one launch, each on its own state (and rows, for a verify); long
         * segments without rows in chunks instead, as on the CPU (cpu_kda_forward) */
        PROF(s, "kda recurrence");
        if (!raw)
            TRY(ds_cu_kda_recurrent_batch(cu, o, q, k, v, g, beta, s->seg_off, s->S + at,
                                          s->any_rows ? s->S_rows + at : NULL, slot_n, s->n_seq, H,
                                          dk, dk, n_chunked ? s->m->opts.kda_chunked_min : 0, err));
        const ds_cu_kda_raw rw = {.A_log = w->A_log,
                                  .dt_bias = w->dt_bias,
                                  .lower_bound_form = c->has_gate_lower_bound,
                                  .lb = c->gate_lower_bound,
                                  .b_in = braw,
                                  .ld_b = ld,
                                  .q_scale = q_scale,
                                  .eps = eps};
        if (n_chunked) TRY(kda_chunked_segments(s, o, q, k, v, g, beta, raw ? &rw : NULL, at, err));
    }
    PROF(s, "kda out gate, norm");
    if (!fused) ds_cu_gated_rmsnorm_heads(cu, q, o, gt, w->o_norm, T, H, dk, c->rms_norm_eps);
    PROF(s, "kda o_proj");
    TRY(ds_cu_matmul(cu, out, D, q, P, T, &w->o, err));
    TRY(cuda_tp_sum(s, out, (size_t)T * D, err));
    s->used = mark;
    return DS_OK;
}

/* Segment qi's expanded attention (cuda_mla_forward): its context's latent rows gathered from
 * the pool and expanded by kv_b, the whole context at once or a block of cb rows at a time
 * (cuda_mla_ctx_rows), each block's output merged by its rows' log-sum-exp; o [T][Ha][dvh] gets
 * the segment's rows. */
static int mla_expanded_segment(cstep *s, const cu_mla *w, const uint8_t *pool, const float *q,
                                float *o, int qi, float scale, ds_err *err) {
    const ds_config *c = &s->m->cfg;
    ds_cu *cu = s->c;
    const int Ha = s->m->Ha, R = c->kv_lora_rank, dn = c->qk_nope_head_dim;
    const int dr = c->qk_rope_head_dim, dvh = c->v_head_dim, dq = dn + dr, row = R + dr;
    const size_t rb = s->pool->row_bytes;
    const int kvd = s->pool->kv_dtype;
    const ds_seq_batch *sb = &s->seqs[qi];
    int n = sb->n, pos0 = sb->pos0, ctx = pos0 + n, r0 = s->off[qi];
    /* the context in blocks of cb rows when it is longer than the block and the fused
     * kernel can merge them (cuda_mla_ctx_rows: the same rule sizes the scratch) */
    const int cb = cuda_mla_ctx_rows(cu, n, ctx, dn, dr, dvh), blocked = cb < ctx;
    size_t m2 = s->used;
    float *cl = take(s, (size_t)cb * R);                        /* [cb][R] */
    float *kr = take(s, (size_t)cb * dr);                       /* [cb][dr] */
    float *kvb = take(s, (size_t)cb * Ha * (dn + dvh));         /* [cb][Ha][dn+dvh] */
    float *kn = take(s, (size_t)cb * Ha * dn);                  /* [cb][Ha][dn] */
    float *vv = take(s, (size_t)cb * Ha * dvh);                 /* [cb][Ha][dvh] */
    float *ob = blocked ? take(s, (size_t)n * Ha * dvh) : NULL; /* [n][Ha][dvh] a block's */
    float *la = blocked ? take(s, (size_t)n * Ha) : NULL;       /* [n][Ha] lse so far */
    float *lb = blocked ? take(s, (size_t)n * Ha) : NULL;       /* [n][Ha] a block's lse */
    TAKEN();
    float *os = o + (size_t)r0 * Ha * dvh;
    const float *qs = q + (size_t)r0 * Ha * dq;
    for (int k0 = 0; k0 < ctx; k0 += cb) {
        const int nk = DS_MIN(cb, ctx - k0);
        const int32_t *rows = s->ctx_rows + s->ctx_off[qi] + k0;
        PROF(s, "mla expanded kv_b");
        if (kvd != DS_KV_F32) {
            TRY(ds_cu_kv_gather(cu, kvd, cl, kr, pool, rb, rows, nk, R, dr, err));
        } else {
            const float *pf = (const float *)pool;
            TRY(ds_cu_move_rows(cu, cl, (size_t)R, NULL, pf, (size_t)row, rows, nk, R, err));
            TRY(ds_cu_move_rows(cu, kr, (size_t)dr, NULL, pf + R, (size_t)row, rows, nk, dr, err));
        }
        TRY(ds_cu_matmul(cu, kvb, Ha * (dn + dvh), cl, R, nk, &w->kv_b, err));
        TRY(ds_cu_copy_2d(cu, kn, (size_t)dn, kvb, (size_t)(dn + dvh), (size_t)dn, (size_t)nk * Ha,
                          err));
        TRY(ds_cu_copy_2d(cu, vv, (size_t)dvh, kvb + dn, (size_t)(dn + dvh), (size_t)dvh,
                          (size_t)nk * Ha, err));
        PROF(s, "mla expanded attend");
        if (!blocked) {
            TRY(ds_cu_mla_attend_expanded(cu, os, qs, kn, kr, vv, n, ctx, Ha, dn, dr, dvh, pos0, 1,
                                          scale, err));
        } else { /* this block's keys sit at positions k0..: the queries at pos0 - k0 .. */
            TRY(ds_cu_mla_attend_expanded_lse(cu, k0 ? ob : os, k0 ? lb : la, qs, kn, kr, vv, n, nk,
                                              Ha, dn, dr, dvh, pos0 - k0, 1, scale, err));
            if (k0) TRY(ds_cu_mla_merge_lse(cu, os, la, ob, lb, n * Ha, dvh, err));
        }
    }
    s->used = m2;
    return DS_OK;
}

/* out[T][D] = MLA(xn), writing this step's latent rows into the pool (cpu_mla_forward). */
int cuda_mla_forward(cstep *s, const layer_w *lw, const cu_mla *w, const float *xn, float *out,
                     ds_err *err) {
    const ds_config *c = &s->m->cfg;
    ds_cu *cu = s->c;
    int T = s->T, D = c->hidden_size, Ha = s->m->Ha, R = c->kv_lora_rank;
    int dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dvh = c->v_head_dim, dq = dn + dr;
    int row = R + dr, Rq = c->q_lora_rank, bs = s->pool->block_size;
    /* the pool's rows, f32, FP8 or BF16: every attention below reads them as stored, this step's
     * own rows included (docs/quantization.md §4) */
    uint8_t *pool = s->pool->layer[lw->kind_idx];
    const size_t rb = s->pool->row_bytes;
    const int kvd = s->pool->kv_dtype;
    size_t mark = s->used;
    float *q = take(s, (size_t)T * Ha * dq);         /* [T][Ha][dn+dr] */
    float *kv = take(s, (size_t)T * row);            /* [T][R+dr] this step's latent rows */
    float *o = take(s, (size_t)T * Ha * dvh);        /* [T][Ha][dvh] */
    float *qa = Rq ? take(s, (size_t)T * Rq) : NULL; /* [T][Rq] */
    /* [T][Ha*dvh] sigmoid(x W_g): the output gate */
    float *gt = c->mla_use_output_gate ? take(s, (size_t)T * Ha * dvh) : NULL;
    TAKEN();
    PROF(s, "mla q, kv_a");
    /* this step's latent rows (kv_a, its norm, into the pool) on the side stream, beside the
     * queries; joined before attending */
    TRY(ds_cu_side_begin(cu, err));
    int rc = ds_cu_matmul(cu, kv, row, xn, D, T, &w->kv_a, err);
    if (!rc) ds_cu_rmsnorm_ld(cu, kv, row, kv, row, w->kv_a_norm, T, R, 1e-6f);
    if (!rc && kvd != DS_KV_F32)
        rc = ds_cu_kv_store(cu, kvd, pool, rb, s->lat_dst, kv, (size_t)row, T, R, dr, err);
    else if (!rc)
        rc = ds_cu_move_rows(cu, (float *)pool, (size_t)row, s->lat_dst, kv, (size_t)row, NULL, T,
                             row, err);
    TRY(ds_cu_side_end(cu, err));
    TRY(rc);
    if (Rq) {
        TRY(ds_cu_matmul(cu, qa, Rq, xn, D, T, &w->q_a, err));
        ds_cu_rmsnorm(cu, qa, qa, w->q_a_norm, T, Rq, 1e-6f);
        TRY(ds_cu_matmul(cu, q, Ha * dq, qa, Rq, T, &w->q_b, err));
    } else {
        TRY(ds_cu_matmul(cu, q, Ha * dq, xn, D, T, &w->q, err));
    }
    TRY(ds_cu_side_join(cu, err));
    float scale = 1.0f / sqrtf((float)dq);
    int run0 = -1; /* consecutive short segments: one absorbed run (as on the CPU) */
    for (int qi = 0; qi <= s->n_seq; qi++) {
        int expanded = qi < s->n_seq && s->plan->mla_expanded[qi];
        if (run0 >= 0 && (qi == s->n_seq || expanded)) {
            int r_start = s->off[run0], Tr = s->off[qi - 1] + s->seqs[qi - 1].n - r_start;
            size_t m2 = s->used;
            float *qbar = take(s, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            float *obar = take(s, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            TAKEN();
            const float *qs = q + (size_t)r_start * Ha * dq;
            PROF(s, "mla absorbed q, o");
            /* q̄_h = W_UK_h^T qN_h, every head in one launch */
            TRY(ds_cu_matmul_heads(cu, qbar, Ha * R, R, qs, Ha * dq, dq, Tr, &w->ukT,
                                   (size_t)R * dn, Ha, err));
            /* the run's sequences in one launch; the context bound is the step's power-of-two
             * cap, so that a graph stays valid while the contexts grow under it */
            PROF(s, "mla absorbed attend");
            /* the rope part of each query read in place (stride dq) */
            TRY(ds_cu_mla_attend_absorbed_batch(
                cu, obar, qbar, qs + dn, dq, Tr, Ha, R, dr, pool, kvd, s->bt, s->tok_bt + r_start,
                s->tok_pos + r_start, s->ctx_cap, bs, rb, scale, err));

            PROF(s, "mla absorbed q, o");
            /* o_h = W_UV_h ō_h: kv_b rows [h (dn+dvh) + dn, +dvh), every head in one launch */
            ds_cu_mat uv = {w->kv_b.data + (size_t)dn * R, dvh, R, DS_CU_BF16, NULL, NULL, 0};
            TRY(ds_cu_matmul_heads(cu, o + (size_t)r_start * Ha * dvh, Ha * dvh, dvh, obar, Ha * R,
                                   R, Tr, &uv, (size_t)(dn + dvh) * R, Ha, err));
            s->used = m2;
            run0 = -1;
        }
        if (qi == s->n_seq) break;
        if (!expanded) {
            if (run0 < 0) run0 = qi;
            continue;
        }
        TRY(mla_expanded_segment(s, w, pool, q, o, qi, scale, err));
    }
    PROF(s, "mla gate, o_proj");
    if (gt) {
        TRY(ds_cu_matmul(cu, gt, Ha * dvh, xn, D, T, &w->g, err));
        ds_cu_mul_sigmoid(cu, o, gt, (size_t)T * Ha * dvh);
    }
    TRY(ds_cu_matmul(cu, out, D, o, Ha * dvh, T, &w->o, err));
    TRY(cuda_tp_sum(s, out, (size_t)T * D, err));
    s->used = mark;
    return DS_OK;
}

/* y[T][rows of down] = down act(gate x, up x) — dense MLP and shared experts; gu is gate and up
 * stacked ([2I][D]), so both come from one weight stream. */
static int mlp_in(cstep *s, const ds_cu_mat *gu, const ds_cu_mat *down, const float *x, int T,
                  float *y, float *h, ds_err *err) {
    const ds_config *c = &s->m->cfg;
    int D = gu->cols, I = gu->rows / 2;
    TRY(ds_cu_matmul(s->c, h, 2 * I, x, D, T, gu, err));
    ds_cu_act_pairs(s->c, h, T, I, c->hidden_act == DS_ACT_SITU, c->situ_beta, c->situ_linear_beta);
    TRY(ds_cu_matmul(s->c, y, down->rows, h, 2 * I, T, down, err));
    return DS_OK;
}

static int mlp(cstep *s, const ds_cu_mat *gu, const ds_cu_mat *down, const float *x, int T,
               float *y, ds_err *err) {
    size_t mark = s->used;
    float *h = take(s, (size_t)T * gu->rows); /* [T][2I]: gate | up, then act in the gate half */
    TAKEN();
    TRY(mlp_in(s, gu, down, x, T, y, h, err));
    s->used = mark;
    return DS_OK;
}

/* out[T][D] = FFN(xn) (cpu_ffn_forward). */
int cuda_ffn_forward(cstep *s, const cu_ffn *w, int is_moe, const float *xn, float *out,
                     ds_err *err) {
    const ds_config *c = &s->m->cfg;
    ds_cu *cu = s->c;
    int T = s->T, D = c->hidden_size;
    if (!is_moe) {
        PROF(s, "dense mlp");
        TRY(mlp(s, &w->gu, &w->down, xn, T, out, err));
        return cuda_tp_sum(s, out, (size_t)T * D, err);
    }
    int E = c->num_experts, K = c->num_experts_per_token, Ie = c->moe_intermediate_size;
    int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : D;
    int latent = c->routed_expert_hidden_size > 0, shared = c->num_shared_experts > 0;
    int e0 = s->m->e0, El = s->m->e1 - s->m->e0; /* this rank's experts */
    size_t mark = s->used;
    float *z = take(s, (size_t)T * E);                            /* [T][E] router logits */
    float *wt = take(s, (size_t)T * K);                           /* [T][K] combine weights */
    int32_t *idx = (int32_t *)take(s, (size_t)T * K);             /* [T][K] chosen experts */
    float *u = latent ? take(s, (size_t)T * Hin) : NULL;          /* [T][Hin] expert input */
    float *acc = latent ? take(s, (size_t)T * Hin) : out;         /* [T][Hin] routed sum */
    float *sh = latent && shared ? take(s, (size_t)T * D) : NULL; /* [T][D] */
    /* [T][2 Is] the shared experts' gate | up, held for the whole call (they run beside) */
    float *hs = shared && !latent ? take(s, (size_t)T * w->sh_gu.rows) : NULL;
    TAKEN();
    /* Without a latent the shared experts go first, straight into out, and the routed sum is
     * added onto them by the expert kernel (a + b == b + a: the CPU's sum, bit for bit). They
     * run on the side stream, beside the router and the routed experts (the expert kernel
     * joins before it adds onto out). */
    PROF(s, "moe shared experts");
    if (shared && !latent) {
        TRY(ds_cu_side_begin(cu, err));
        int rc = mlp_in(s, &w->sh_gu, &w->sh_down, xn, T, out, hs, err);
        TRY(ds_cu_side_end(cu, err));
        TRY(rc);
    }
    PROF(s, "moe router");
    TRY(ds_cu_matmul(cu, z, E, xn, D, T, &w->router, err));
    TRY(ds_cu_moe_route(cu, idx, wt, z, w->router_bias, T, E, K,
                        c->use_grouped_topk ? c->num_expert_group : 1, c->topk_group,
                        c->moe_renormalize, c->routed_scaling_factor, s->m->opts.hf_kl_router_quirk,
                        err));
    {
        /* the chosen experts' weights start for L2 now (ds_cu_set_l2_prefetch) */
        const size_t per = (size_t)Ie * Hin;
        const int packed = w->experts_mxfp4 || w->experts_fp8; /* codes, not BF16 */
        const void *gu = packed ? (const void *)w->gu_codes : (const void *)w->gate_up;
        const void *dn = packed ? (const void *)w->dn_codes : (const void *)w->e_down;
        /* bytes an expert: BF16 2 a weight, FP8 1, MXFP4 a half */
        const size_t gub = w->experts_mxfp4 ? per : w->experts_fp8 ? 2 * per : 4 * per;
        TRY(ds_cu_l2_mark(cu, err));
        TRY(ds_cu_l2_prefetch_experts(cu, idx, T * K, e0, El, gu, gub, dn, gub / 2, err));
    }
    const float *ein = xn;
    if (latent) {
        TRY(ds_cu_matmul(cu, u, Hin, xn, D, T, &w->lat_down, err));
        ein = u;
    }
    PROF(s, "moe routed experts");
    int situ = c->hidden_act == DS_ACT_SITU, chunk = 65535 / K;
    for (int t0 = 0; t0 < T; t0 += chunk) { /* the expert kernel takes 65535 routed rows */
        int n = DS_MIN(chunk, T - t0);
        if (w->experts_mxfp4)
            TRY(ds_cu_moe_experts_mxfp4(
                cu, acc + (size_t)t0 * Hin, ein + (size_t)t0 * Hin, idx + (size_t)t0 * K,
                wt + (size_t)t0 * K, n, K, El, e0, Hin, Ie, w->gu_codes, w->gu_scales, w->dn_codes,
                w->dn_scales, situ, c->situ_beta, c->situ_linear_beta, shared && !latent, err));
        else if (w->experts_fp8)
            TRY(ds_cu_moe_experts_fp8(cu, acc + (size_t)t0 * Hin, ein + (size_t)t0 * Hin,
                                      idx + (size_t)t0 * K, wt + (size_t)t0 * K, n, K, El, e0, Hin,
                                      Ie, w->gu_codes, (const float *)w->gu_scales, w->dn_codes,
                                      (const float *)w->dn_scales, situ, c->situ_beta,
                                      c->situ_linear_beta, shared && !latent, err));
        else
            TRY(ds_cu_moe_experts(cu, acc + (size_t)t0 * Hin, ein + (size_t)t0 * Hin,
                                  idx + (size_t)t0 * K, wt + (size_t)t0 * K, n, K, El, e0, Hin, Ie,
                                  w->gate_up, w->e_down, situ, c->situ_beta, c->situ_linear_beta,
                                  shared && !latent, err));
    }
    TRY(ds_cu_l2_mark(cu, err));   /* the next weight stream's prefetch starts after them */
    TRY(ds_cu_side_join(cu, err)); /* (already, unless no expert kernel ran) */
    PROF(s, "moe combine");
    if (latent) {
        /* the latent norm is nonlinear: the routed sum is completed first (as on the CPU) */
        TRY(cuda_tp_sum(s, acc, (size_t)T * Hin, err));
        if (w->lat_norm) ds_cu_rmsnorm(cu, acc, acc, w->lat_norm, T, Hin, c->rms_norm_eps);
        TRY(ds_cu_matmul(cu, out, D, acc, Hin, T, &w->lat_up, err));
        if (shared) {
            TRY(mlp(s, &w->sh_gu, &w->sh_down, xn, T, sh, err));
            TRY(cuda_tp_sum(s, sh, (size_t)T * D, err));
            ds_cu_add(cu, out, sh, (size_t)T * D);
        }
    } else {
        TRY(cuda_tp_sum(s, out, (size_t)T * D,
                        err)); /* routed + shared partials in one all-reduce */
    }
    s->used = mark;
    return DS_OK;
}
