/* draft.c — the DSpark draft on the GPU (model_draft.c's device path; the table's draft_*).
 * The same data flow as the CPU draft (model_draft.c's header), through this backend's kernels:
 * the block pass's matmuls, norms, absorbed MLA over the draft's paged latent rows (the spare
 * pages of a proposal included), the target's lm_head over the block and the Markov walk's bias
 * and argmax all stay on the GPU; what crosses to the host is the taps in (as the target's step
 * returned them), a few row indices, and one 8-byte key a part of each walk step out. Its weights
 * are uploaded into the target's allocations (freed with the target, which outlives the draft
 * anyway). */
#include "backend/cuda/internal.h"

typedef struct cu_draft_layer {
    float *in_norm, *post_norm; /* [D] */
    cu_mla mla;                 /* q or q_a / q_b, kv_a, kv_b (with ukT), o; g unused */
    ds_cu_mat gate, up, down;
} cu_draft_layer;

typedef struct ds_draft_dev {
    ds_cuda_model *cm;
    ds_cu_mat embed, lm_head; /* [V][D] each (the target's where it holds them whole) */
    ds_cu_mat *ctx_blocks;    /* [n_taps] W_context[:, tap j], [D][Dt] */
    float *context_norm, *final_norm;
    cu_draft_layer *layers; /* [L] */
    ds_cu_mat markov_w1, markov_w2;
    float *buf; /* device scratch, buf_cap floats, carved per call */
    size_t buf_cap;
    int32_t *ibuf; /* device indices, ibuf_cap ints */
    size_t ibuf_cap;
    int32_t *hi; /* host staging of those indices, hi_cap ints */
    size_t hi_cap;
    float *hcs; /* host rotations [max rows][dr/2][2], hcs_cap floats */
    size_t hcs_cap;
    uint64_t *hk; /* a walk step's argmax part keys [n][parts], hk_cap */
    size_t hk_cap;
} ds_draft_dev;

int cuda_draft_create(ds_draft *d, const ds_model *target, ds_err *err) {
    ds_cuda_model *cm = target->be_ctx;
    if (!cm || !cm->tune.draft_device) return DS_OK;
    const ds_draft_config *c = &d->cfg;
    ds_draft_dev *g = calloc(1, sizeof *g);
    if (!g) return ds_errf(err, "draft on the GPU: out of host memory");
    d->dev = g;
    g->cm = cm;
    /* the draft reads the whole vocabulary's lm_head: the target's where this rank holds all of
     * it, else (a vocabulary-parallel rank) a copy of the whole from the host's view */
    if (cm->lm_head.data && target->v0 == 0 && target->nv == c->vocab_size)
        g->lm_head = cm->lm_head;
    else if (cuda_up_mat(cm, d->lm_head, &g->lm_head, err))
        return DS_ERR;
    int L = c->num_hidden_layers, n_taps = c->num_target_layers;
    g->layers = calloc((size_t)L, sizeof *g->layers);
    g->ctx_blocks = calloc((size_t)n_taps, sizeof *g->ctx_blocks);
    if (!g->layers || !g->ctx_blocks) return ds_errf(err, "draft on the GPU: out of host memory");
    /* the target's embedding where this stage holds all of it, else the draft's own copy */
    if (cm->embed.data && target->v0 == 0 && target->nv == c->vocab_size)
        g->embed = cm->embed;
    else if (cuda_up_mat(cm, d->embed, &g->embed, err))
        return DS_ERR;
    for (int j = 0; j < n_taps; j++)
        if (cuda_up_mat(cm, &d->ctx_blocks[j], &g->ctx_blocks[j], err)) return DS_ERR;
    if (cuda_up_vec(cm, d->context_norm, (size_t)c->hidden_size, &g->context_norm, err) ||
        cuda_up_vec(cm, d->final_norm, (size_t)c->hidden_size, &g->final_norm, err) ||
        cuda_up_mat(cm, &d->markov_w1, &g->markov_w1, err) ||
        cuda_up_mat(cm, &d->markov_w2, &g->markov_w2, err))
        return DS_ERR;
    for (int l = 0; l < L; l++) {
        const draft_layer *w = &d->layers[l];
        cu_draft_layer *x = &g->layers[l];
        /* up_mla's model: the draft's heads, all of them on this one process */
        ds_model shape = {0};
        shape.cfg.kv_lora_rank = c->kv_lora_rank;
        shape.cfg.qk_nope_head_dim = c->qk_nope_head_dim;
        shape.cfg.v_head_dim = c->v_head_dim;
        shape.cfg.q_lora_rank = c->q_lora_rank;
        shape.Ha = c->num_attention_heads;
        mla_w mw = {w->q, w->q_a, w->q_b, w->q_a_norm, w->kv_a, w->kv_a_norm, w->kv_b, w->o, {0}};
        if (cuda_up_mla(cm, &shape, &mw, &x->mla, err) ||
            cuda_up_vec(cm, w->in_norm, (size_t)c->hidden_size, &x->in_norm, err) ||
            cuda_up_vec(cm, w->post_norm, (size_t)c->hidden_size, &x->post_norm, err) ||
            cuda_up_mat(cm, &w->gate, &x->gate, err) || cuda_up_mat(cm, &w->up, &x->up, err) ||
            cuda_up_mat(cm, &w->down, &x->down, err))
            return DS_ERR;
    }
    return ds_cu_sync(cm->c, err);
}

void cuda_draft_free(ds_draft *d) {
    ds_draft_dev *g = d->dev;
    if (!g) return;
    ds_cu_dealloc(g->buf);
    ds_cu_dealloc(g->ibuf);
    free(g->hi);
    free(g->hcs);
    free(g->hk);
    free(g->layers);
    free(g->ctx_blocks);
    free(g);
    d->dev = NULL;
}

/* Cuts n device buffers of sizes[i] floats out of the draft's scratch (grown when short, contents
 * not kept), each on a 64-byte boundary. */
static int dev_carve(ds_draft_dev *g, const size_t *sizes, float **bufs, int n, ds_err *err) {
    size_t need = 0;
    for (int i = 0; i < n; i++) need += (sizes[i] + 15) & ~(size_t)15;
    /* (grow_dev: no graph of the target's step reads the draft's buffers) */
    if (cuda_grow_dev(g->cm->c, (void **)&g->buf, &g->buf_cap, need, sizeof(float), err))
        return DS_ERR;
    float *p = g->buf;
    for (int i = 0; i < n; i++) {
        bufs[i] = p;
        p += (sizes[i] + 15) & ~(size_t)15;
    }
    return DS_OK;
}

/* The n host indices in g->hi to the device (g->ibuf at offset at); returns their device copy. */
static const int32_t *dev_indices(ds_draft_dev *g, size_t at, size_t n, ds_err *err) {
    if (cuda_grow_dev(g->cm->c, (void **)&g->ibuf, &g->ibuf_cap, at + n, sizeof(int32_t), err) ||
        ds_cu_upload(g->cm->c, g->ibuf + at, g->hi + at, n * sizeof(int32_t), err))
        return NULL;
    return g->ibuf + at;
}

static int host_room(ds_draft_dev *g, size_t n_idx, size_t n_cs, ds_err *err) {
    if (cuda_grow_host((void **)&g->hi, &g->hi_cap, n_idx, sizeof(int32_t), err) ||
        cuda_grow_host((void **)&g->hcs, &g->hcs_cap, n_cs, sizeof(float), err))
        return DS_ERR;
    return DS_OK;
}

/* kv [n][R+dr] (W_kva's output) -> [RMSNorm(c) | RoPE(kR)] with cs [n][dr/2][2] (device). */
static int dev_finish_latent(ds_draft *d, const cu_draft_layer *w, float *kv, const float *cs,
                             int n, ds_err *err) {
    const ds_draft_config *c = &d->cfg;
    int R = c->kv_lora_rank, dr = c->qk_rope_head_dim, row = R + dr;
    const ds_draft_dev *g = d->dev;
    ds_cu *cu = g->cm->c;
    ds_cu_rmsnorm_ld(cu, kv, row, kv, row, w->mla.kv_a_norm, n, R, c->rms_norm_eps);
    return ds_cu_rope_pairs(cu, kv + R, row, n, 1, cs, dr / 2, err);
}

int cuda_draft_write_context(ds_draft *d, ds_draft_cache *c, int n_items,
                             const ds_draft_ctx_write *w, ds_err *err) {
    ds_draft_dev *g = d->dev;
    ds_cu *cu = g->cm->c;
    const ds_draft_config *cf = &d->cfg;
    int D = cf->hidden_size, Dt = cf->target_hidden_size, nt = cf->num_target_layers;
    int dr = cf->qk_rope_head_dim, row = cf->kv_lora_rank + dr, bs = c->block_size;
    const int taps = w[0].taps != NULL; /* (every item the same kind: checked by the caller) */
    int N = 0;                          /* the items' rows stacked, item i's from its offset on */
    for (int i = 0; i < n_items; i++) N += w[i].n;
    size_t in_n = taps ? (size_t)nt * N * Dt : (size_t)N * D;
    size_t sizes[5] = {in_n, (size_t)N * D, (size_t)N * D, (size_t)N * row, (size_t)N * dr};
    float *b[5];
    if (dev_carve(g, sizes, b, 5, err) || host_room(g, (size_t)N, (size_t)N * dr, err))
        return DS_ERR;
    /* in: taps [nt][N][Dt] or sums [N][D]; tmp, ctx [N][D]; kv [N][row]; cs [N][dr/2][2] */
    float *in = b[0], *tmp = b[1], *ctx = b[2], *kv = b[3], *cs = b[4];
    for (int i = 0, off = 0; i < n_items; off += w[i].n, i++) {
        const size_t ni = (size_t)w[i].n;
        if (taps)
            for (int j = 0; j < nt; j++)
                TRY(ds_cu_upload(cu, in + ((size_t)j * N + off) * Dt, w[i].taps + j * ni * Dt,
                                 ni * Dt * sizeof(float), err));
        else
            TRY(ds_cu_upload(cu, in + (size_t)off * D, w[i].sum, ni * D * sizeof(float), err));
        ds_draft_rope_table(d, g->hcs + (size_t)off * dr, w[i].pos0, w[i].n);
        for (int t = 0; t < w[i].n; t++) {
            const int p = w[i].pos0 + t;
            g->hi[off + t] = w[i].block_table[p / bs] * bs + p % bs; /* its row in a layer */
        }
    }
    if (taps) { /* the sum over taps in tap order, as the CPU's context_add */
        for (int j = 0; j < nt; j++) {
            TRY(ds_cu_matmul(cu, j ? tmp : ctx, D, in + (size_t)j * N * Dt, Dt, N,
                             &g->ctx_blocks[j], err));
            if (j) ds_cu_add(cu, ctx, tmp, (size_t)N * D);
        }
        ds_cu_rmsnorm(cu, ctx, ctx, g->context_norm, N, D, cf->rms_norm_eps);
    } else {
        ds_cu_rmsnorm(cu, ctx, in, g->context_norm, N, D, cf->rms_norm_eps);
    }
    TRY(ds_cu_upload(cu, cs, g->hcs, (size_t)N * dr * sizeof(float), err));
    const int32_t *dst = dev_indices(g, 0, (size_t)N, err);
    if (!dst) return DS_ERR;
    for (int l = 0; l < cf->num_hidden_layers; l++) {
        const cu_draft_layer *lw = &g->layers[l];
        TRY(ds_cu_matmul(cu, kv, row, ctx, D, N, &lw->mla.kv_a, err));
        TRY(dev_finish_latent(d, lw, kv, cs, N, err));
        TRY(ds_cu_move_rows(cu, c->layer[l], (size_t)row, dst, kv, (size_t)row, NULL, N, row, err));
    }
    return ds_cu_sync(cu, err);
}

/* ---- the proposal (cuda_draft_propose) --------------------------------------------------------
 * Rows b T + t (sequence b, block row t) go through the block pass; the final norm's rows are
 * reordered to t n + b so that each walk step's n rows of U are contiguous. */

/* The pass's device buffers, cut from the draft's scratch. */
typedef struct prop_bufs {
    float *h, *x, *a;   /* [NT][D] */
    float *qa;          /* [NT][Rq] */
    float *q;           /* [NT][Ha][dq] */
    float *kv;          /* [NT][row]: the blocks' latent rows */
    float *qr;          /* [NT][Ha][dr] */
    float *qbar, *obar; /* [NT][Ha][R] */
    float *o;           /* [NT][Ha][dvh] */
    float *gg, *u;      /* [NT][I] */
    float *cs;          /* [NT][dr/2][2] */
    float *U;           /* [T][n][V] */
    float *w1;          /* [n][r] */
    float *bias;        /* [n][V] */
    uint64_t *keys;     /* [n][parts] a walk step's part keys */
    float *xr;          /* [T][n][D]: the normed rows in walk order */
} prop_bufs;

/* Where each part of the pass's indices starts (host g->hi, then the device copy):
 * ids [NT] | tables (sequence b's full_b + n_spare) | copy src [n_copy] | copy dst [n_copy] |
 * block rows [NT] | walk order [NT]; n_idx in all. */
typedef struct prop_index {
    size_t at_tab, at_src, at_dst, at_blk, at_ord, n_idx, n_copy;
} prop_index;

static int prop_carve(ds_draft_dev *g, const ds_draft_config *cf, int n, int T, int parts,
                      prop_bufs *pb, ds_err *err) {
    int D = cf->hidden_size, V = cf->vocab_size, Ha = cf->num_attention_heads;
    int R = cf->kv_lora_rank, dn = cf->qk_nope_head_dim, dr = cf->qk_rope_head_dim, dq = dn + dr;
    int dvh = cf->v_head_dim, Rq = cf->q_lora_rank, I = cf->intermediate_size, r = cf->markov_rank;
    int row = R + dr, NT = n * T;
    size_t TD = (size_t)NT * D;
    size_t sizes[] = {
        TD,
        TD,
        TD,                         /* h, x, a [NT][D] */
        (size_t)NT * (Rq ? Rq : 1), /* qa [NT][Rq] */
        (size_t)NT * Ha * dq,       /* q [NT][Ha][dq] */
        (size_t)NT * row,           /* kv [NT][row]: the blocks' latent rows */
        (size_t)NT * Ha * dr,       /* qr [NT][Ha][dr] */
        (size_t)NT * Ha * R,
        (size_t)NT * Ha * R,   /* qbar, obar [NT][Ha][R] */
        (size_t)NT * Ha * dvh, /* o [NT][Ha][dvh] */
        (size_t)NT * I,
        (size_t)NT * I,        /* g, u [NT][I] */
        (size_t)NT * dr,       /* cs [NT][dr/2][2] */
        (size_t)NT * V,        /* U [T][n][V] */
        (size_t)n * r,         /* w1 [n][r] */
        (size_t)n * V,         /* bias [n][V] */
        2 * (size_t)n * parts, /* a walk step's part keys [n][parts] (8 bytes each) */
        TD,                    /* xr [T][n][D]: the normed rows in walk order */
    };
    float *b[DS_ARRAY_LEN(sizes)];
    TRY(dev_carve(g, sizes, b, (int)DS_ARRAY_LEN(sizes), err));
    *pb = (prop_bufs){b[0],
                      b[1],
                      b[2],
                      b[3],
                      b[4],
                      b[5],
                      b[6],
                      b[7],
                      b[8],
                      b[9],
                      b[10],
                      b[11],
                      b[12],
                      b[13],
                      b[14],
                      b[15],
                      (uint64_t *)b[16],
                      b[17]};
    return DS_OK;
}

/* The pass's host indices in g->hi (ix's layout) and rotations in g->hcs. Each sequence's view:
 * its context pages for rows 0..p, then its spare slot's pages (as spare_table); the context rows
 * of the page holding p+1 are copied into the slot's first spare page. */
static int prop_indices(ds_draft *d, const ds_draft_cache *c, int n,
                        const int32_t *const *block_tables, const int *ps, const int32_t *anchors,
                        int T, int parts, prop_index *ix, ds_err *err) {
    ds_draft_dev *g = d->dev;
    const ds_draft_config *cf = &d->cfg;
    int dr = cf->qk_rope_head_dim, bs = c->block_size, NT = n * T;
    size_t n_tab = 0, n_copy = 0;
    for (int q0 = 0; q0 < n; q0++) {
        const int full = (ps[q0] + 1) / bs;
        n_tab += (size_t)full + c->n_spare;
        n_copy += (size_t)(ps[q0] + 1 - full * bs);
    }
    const size_t at_tab = (size_t)NT, at_src = at_tab + n_tab, at_dst = at_src + n_copy;
    const size_t at_blk = at_dst + n_copy, at_ord = at_blk + NT, n_idx = at_ord + NT;
    *ix = (prop_index){at_tab, at_src, at_dst, at_blk, at_ord, n_idx, n_copy};
    TRY(host_room(g, n_idx, (size_t)NT * dr, err));
    if (cuda_grow_host((void **)&g->hk, &g->hk_cap, (size_t)n * parts, sizeof(uint64_t), err))
        return DS_ERR;
    int32_t *hi = g->hi;
    size_t tab = at_tab, cp = 0;
    for (int s0 = 0; s0 < n; s0++) {
        const int p = ps[s0], full = (p + 1) / bs, nc = (p + 1) - full * bs;
        const int32_t *bt = block_tables[s0];
        int32_t *my = hi + tab;
        hi[(size_t)s0 * T] = anchors[s0];
        for (int t = 1; t < T; t++) hi[(size_t)s0 * T + t] = cf->mask_token_id;
        for (int k = 0; k < full; k++) my[k] = bt[k];
        for (int k = 0; k < c->n_spare; k++)
            my[full + k] = c->n_pages + s0 * c->n_spare + k; /* this sequence's spare slot */
        for (int i = 0; i < nc; i++, cp++) {
            const int pos = full * bs + i;
            hi[at_src + cp] = bt[pos / bs] * bs + pos % bs;
            hi[at_dst + cp] = my[pos / bs] * bs + pos % bs;
        }
        for (int t = 0; t < T; t++) {
            const int pos = p + 1 + t;
            hi[at_blk + (size_t)s0 * T + t] = my[pos / bs] * bs + pos % bs;
            hi[at_ord + (size_t)t * n + s0] = s0 * T + t;
        }
        ds_draft_rope_table(d, g->hcs + (size_t)s0 * T * dr, p + 1, T);
        tab += (size_t)full + c->n_spare;
    }
    return DS_OK;
}

/* Layer l of the block pass over pb->h (di: the indices on the device, ix's layout). */
static int prop_layer(ds_draft *d, ds_draft_cache *c, int l, const prop_bufs *pb, const int32_t *di,
                      const prop_index *ix, int n, int T, const int *ps, ds_err *err) {
    ds_draft_dev *g = d->dev;
    ds_cu *cu = g->cm->c;
    const ds_draft_config *cf = &d->cfg;
    int D = cf->hidden_size, Ha = cf->num_attention_heads;
    int R = cf->kv_lora_rank, dn = cf->qk_nope_head_dim, dr = cf->qk_rope_head_dim, dq = dn + dr;
    int dvh = cf->v_head_dim, Rq = cf->q_lora_rank, I = cf->intermediate_size;
    int row = R + dr, bs = c->block_size, NT = n * T;
    float eps = cf->rms_norm_eps;
    size_t TD = (size_t)NT * D;
    float *h = pb->h, *x = pb->x, *a = pb->a, *qa = pb->qa, *q = pb->q, *kv = pb->kv;
    float *qr = pb->qr, *qbar = pb->qbar, *obar = pb->obar, *o = pb->o, *gg = pb->gg, *u = pb->u;
    const float *cs = pb->cs;
    const int32_t *csrc = di + ix->at_src, *cdst = di + ix->at_dst, *blk = di + ix->at_blk;
    const size_t n_copy = ix->n_copy;
    const cu_draft_layer *w = &g->layers[l];
    const cu_mla *m = &w->mla;
    float *pool = c->layer[l];
    if (n_copy)
        TRY(ds_cu_move_rows(cu, pool, (size_t)row, cdst, pool, (size_t)row, csrc, (int)n_copy, row,
                            err));
    ds_cu_rmsnorm(cu, x, h, w->in_norm, NT, D, eps);
    /* MLA (block_attention): queries, the blocks' latent rows into the spare pages, absorbed
     * attention over context and block (non-causal, a launch per sequence: each its own
     * view), the output projection */
    if (Rq) {
        TRY(ds_cu_matmul(cu, qa, Rq, x, D, NT, &m->q_a, err));
        ds_cu_rmsnorm(cu, qa, qa, m->q_a_norm, NT, Rq, eps);
        TRY(ds_cu_matmul(cu, q, Ha * dq, qa, Rq, NT, &m->q_b, err));
    } else {
        TRY(ds_cu_matmul(cu, q, Ha * dq, x, D, NT, &m->q, err));
    }
    TRY(ds_cu_matmul(cu, kv, row, x, D, NT, &m->kv_a, err));
    TRY(dev_finish_latent(d, w, kv, cs, NT, err));
    TRY(ds_cu_move_rows(cu, pool, (size_t)row, blk, kv, (size_t)row, NULL, NT, row, err));
    /* qR turns at its own row's position (trap 9): row t h of qr at cs row t */
    TRY(ds_cu_copy_2d(cu, qr, (size_t)dr, q + dn, (size_t)dq, (size_t)dr, (size_t)NT * Ha, err));
    TRY(ds_cu_rope_pairs(cu, qr, dr, NT * Ha, Ha, cs, dr / 2, err));
    TRY(ds_cu_matmul_heads(cu, qbar, Ha * R, R, q, Ha * dq, dq, NT, &m->ukT, (size_t)R * dn, Ha,
                           err));
    const int32_t *table = di + ix->at_tab; /* sequence s0's, then the next one's */
    for (int s0 = 0; s0 < n; s0++) {
        const size_t r0 = (size_t)s0 * T * Ha;
        TRY(ds_cu_mla_attend_absorbed(cu, obar + r0 * R, qbar + r0 * R, qr + r0 * dr, T, Ha, R, dr,
                                      pool, table, bs, row, ps[s0] + 1, ps[s0] + 1 + T, 0,
                                      (float)d->yarn.softmax_scale, err));
        table += (ps[s0] + 1) / bs + c->n_spare;
    }
    ds_cu_mat uv = {m->kv_b.data + (size_t)dn * R, dvh, R, DS_CU_BF16, NULL, NULL, 0};
    TRY(ds_cu_matmul_heads(cu, o, Ha * dvh, dvh, obar, Ha * R, R, NT, &uv, (size_t)(dn + dvh) * R,
                           Ha, err));
    TRY(ds_cu_matmul(cu, a, D, o, Ha * dvh, NT, &m->o, err));
    ds_cu_add(cu, h, a, TD);
    /* SwiGLU MLP */
    ds_cu_rmsnorm(cu, x, h, w->post_norm, NT, D, eps);
    TRY(ds_cu_matmul(cu, gg, I, x, D, NT, &w->gate, err));
    TRY(ds_cu_matmul(cu, u, I, x, D, NT, &w->up, err));
    ds_cu_swiglu(cu, gg, gg, u, (size_t)NT * I);
    TRY(ds_cu_matmul(cu, a, D, gg, I, NT, &w->down, err));
    ds_cu_add(cu, h, a, TD);
    return DS_OK;
}

/* The Markov walks, a step for all n together: row k's logits plus W2 · W1[previous token], the
 * argmax the next token. */
static int prop_walk(ds_draft *d, const prop_bufs *pb, int n, const int32_t *anchors, int T,
                     int parts, int32_t *drafts, ds_err *err) {
    ds_draft_dev *g = d->dev;
    ds_cu *cu = g->cm->c;
    int V = d->cfg.vocab_size, r = d->cfg.markov_rank;
    int32_t *hi = g->hi;
    uint64_t *hk = g->hk;
    for (int s0 = 0; s0 < n; s0++) hi[s0] = anchors[s0];
    for (int k = 0; k < T; k++) {
        const int32_t *dprev = dev_indices(g, 0, (size_t)n, err);
        if (!dprev) return DS_ERR;
        ds_cu_embed(cu, pb->w1, &g->markov_w1, dprev, n);
        TRY(ds_cu_matmul(cu, pb->bias, V, pb->w1, r, n, &g->markov_w2, err));
        ds_cu_add(cu, pb->bias, pb->U + (size_t)k * n * V, (size_t)n * V);
        ds_cu_argmax_rows(cu, pb->keys, pb->bias, n, V, parts);
        TRY(ds_cu_download(cu, hk, pb->keys, (size_t)n * parts * sizeof(uint64_t), err));
        TRY(ds_cu_sync(cu, err));
        for (int s0 = 0; s0 < n; s0++)
            hi[s0] = drafts[(size_t)s0 * T + k] =
                ds_cu_argmax_token(hk + (size_t)s0 * parts, parts);
    }
    return DS_OK;
}

int cuda_draft_propose(ds_draft *d, ds_draft_cache *c, int n, const int32_t *const *block_tables,
                       const int *ps, const int32_t *anchors, int T, int32_t *drafts,
                       float *block_logits, ds_err *err) {
    ds_draft_dev *g = d->dev;
    ds_cu *cu = g->cm->c;
    const ds_draft_config *cf = &d->cfg;
    int D = cf->hidden_size, V = cf->vocab_size, dr = cf->qk_rope_head_dim, NT = n * T;
    const int parts = ds_cu_argmax_parts(n, V);
    prop_bufs pb;
    prop_index ix;
    TRY(prop_carve(g, cf, n, T, parts, &pb, err));
    TRY(prop_indices(d, c, n, block_tables, ps, anchors, T, parts, &ix, err));
    const int32_t *di = dev_indices(g, 0, ix.n_idx, err);
    if (!di) return DS_ERR;
    const int32_t *ids = di, *ord = di + ix.at_ord;
    TRY(ds_cu_upload(cu, pb.cs, g->hcs, (size_t)NT * dr * sizeof(float), err));
    ds_cu_embed(cu, pb.h, &g->embed, ids, NT);
    for (int l = 0; l < cf->num_hidden_layers; l++)
        TRY(prop_layer(d, c, l, &pb, di, &ix, n, T, ps, err));
    ds_cu_rmsnorm(cu, pb.x, pb.h, g->final_norm, NT, D, cf->rms_norm_eps);
    TRY(ds_cu_move_rows(cu, pb.xr, (size_t)D, NULL, pb.x, (size_t)D, ord, NT, D, err));
    TRY(ds_cu_matmul(cu, pb.U, V, pb.xr, D, NT, &g->lm_head, err));
    if (block_logits) /* [n][T][V] for the caller, from walk order */
        for (int s0 = 0; s0 < n; s0++)
            for (int t = 0; t < T; t++)
                TRY(ds_cu_download(cu, block_logits + ((size_t)s0 * T + t) * V,
                                   pb.U + ((size_t)t * n + s0) * V, (size_t)V * sizeof(float),
                                   err));
    return prop_walk(d, &pb, n, anchors, T, parts, drafts, err);
}
