/* step.c — one step of the forward pass on the CUDA backend (the table's forward).
 *
 * The data flow is the CPU backend's run_step (src/backend/cpu/forward.c), op for op, with each
 * op a kernel of kernels/cuda on device buffers:
 *   embed -> for each layer: [AttnRes mix] -> RMSNorm -> KDA | MLA -> [AttnRes mix] -> RMSNorm ->
 *   dense MLP | MoE -> ... -> [output AttnRes mix] -> final RMSNorm -> lm_head.
 *
 * Memory: the weights are uploaded once at attach (BF16 matrices, f32 vectors); the latent pool,
 * the KDA slots and the verify rows are device memory the engine allocated through base/devmem.h.
 * Per step the host builds every index the step needs (token ids, segment offsets, pool rows,
 * block tables, state pointers, AttnRes candidate lists) in two arenas and uploads each once;
 * tokens come from the host and logits, hidden states and taps go back to it. A decode or verify
 * step is replayed from a CUDA graph.
 *
 * Under tensor parallelism the sums go through NCCL where the group set it up, else through the
 * host; pipeline stages work, their tensors crossing through the host as on the CPU. */
#include "backend/cuda/internal.h"
#ifdef DS_HAVE_NCCL
#include "transport/comm_nccl.h"
#endif

/* Scratch floats one step takes at most (mirrors the take calls below, 16 floats of slack each). */
static size_t cuda_step_need(const ds_model *m, const ds_cu *cu, const ds_step_plan *plan,
                             const ds_seq_batch *seqs, int n_seq, int T) {
    const ds_config *c = &m->cfg;
    size_t t = (size_t)T, D = (size_t)c->hidden_size, L = (size_t)c->num_hidden_layers;
    size_t N = (size_t)c->attn_res_block_size, pad = 16;
    size_t base = 3 * t * D + (N ? ((L + N - 1) / N + 1) * (t * D + pad) : 0) + 6 * pad;
    size_t H = (size_t)m->Hk, dk = (size_t)c->kda_head_dim, P = H * dk;
    size_t kda = m->n_kda ? 9 * t * P + 2 * t * dk + 2 * t * H + 11 * pad : 0; /* kda_forward */
    size_t mla = 0;
    if (m->n_mla) {
        size_t Ha = (size_t)m->Ha, R = (size_t)c->kv_lora_rank;
        size_t dn = (size_t)c->qk_nope_head_dim, dr = (size_t)c->qk_rope_head_dim;
        size_t dvh = (size_t)c->v_head_dim, seg = 0, short_rows = 0;
        for (int q = 0; q < n_seq; q++) {
            const int n = seqs[q].n, ctx = seqs[q].pos0 + n;
            /* the context expanded a block at a time (cuda_mla_ctx_rows) needs the block's
             * rows and, blocked, a block's outputs and both log-sum-exp rows */
            const size_t cb = (size_t)cuda_mla_ctx_rows(cu, n, ctx, (int)dn, (int)dr, (int)dvh);
            const size_t merge = cb < (size_t)ctx ? (size_t)n * Ha * (dvh + 2) + 3 * pad : 0;
            if (plan->mla_expanded[q])
                seg = DS_MAX(seg, cb * (R + dr + 2 * Ha * (dn + dvh)) + 5 * pad + merge);
            else
                short_rows += (size_t)seqs[q].n; /* absorbed runs hold at most these rows */
        }
        seg = DS_MAX(seg, short_rows * Ha * (dr + 2 * R) + 3 * pad);
        mla = t * Ha * (dn + dr) + t * (R + dr) + 2 * t * Ha * dvh + t * (size_t)c->q_lora_rank +
              5 * pad + seg;
    }
    size_t ffn = 2 * t * (size_t)c->intermediate_size + 2 * pad;
    if (c->num_experts) {
        size_t E = (size_t)c->num_experts, K = (size_t)c->num_experts_per_token;
        size_t Hin = c->routed_expert_hidden_size ? (size_t)c->routed_expert_hidden_size : D;
        size_t Is = (size_t)c->moe_intermediate_size * (size_t)c->num_shared_experts;
        ffn = DS_MAX(ffn, t * E + 2 * t * K + 2 * t * Hin + t * D + 2 * t * Is + 8 * pad);
        /* (mlp: one [T][2I] buffer, as the dense estimate above) */
    }
    size_t lg = 0;
    if (m->l1 == (int)L) {
        size_t nl = 0;
        for (int q = 0; q < n_seq; q++) nl += (size_t)ds_seq_logit_rows(&seqs[q]);
        /* xr, lg and the greedy tokens' keys (ds_cu_argmax_parts: rows x parts <= rows + 264) */
        lg = nl * (D + (size_t)m->vp) + 2 * (nl + 264) + 3 * pad;
    }
    return base + lg + DS_MAX(DS_MAX(kda, mla), ffn);
}

/* Grows a device buffer (contents not kept), with room for the next, slightly larger need. */
int cuda_grow_dev(ds_cu *c, void **p, size_t *cap, size_t need, size_t elem, ds_err *err) {
    if (need <= *cap) return DS_OK;
    need += need / 4;
    ds_cu_dealloc(*p);
    *p = ds_cu_alloc(c, need * elem, err);
    *cap = *p ? need : 0;
    return *p ? DS_OK : DS_ERR;
}

/* cuda_grow_dev for a buffer of cm the step's graphs read or write: a move bumps its epoch, which
 * drops them (graphs captured before point into the old buffer). */
static int grow(ds_cuda_model *cm, void **p, size_t *cap, size_t need, size_t elem, ds_err *err) {
    if (need <= *cap) return DS_OK;
    cm->own_epoch++;
    return cuda_grow_dev(cm->c, p, cap, need, elem, err);
}

int cuda_grow_host(void **p, size_t *cap, size_t need, size_t elem, ds_err *err) {
    if (need <= *cap) return DS_OK;
    void *b = realloc(*p, need * elem);
    if (!b)
        return ds_errf(err, "cuda: out of host memory (%zu bytes of step indices)", need * elem);
    *p = b;
    *cap = need;
    return DS_OK;
}

void cuda_step_times_add(ds_cuda_model *cm, double host_s, double dev_ms) {
    if (dev_ms < 0) return;
    if (!cm->st.n || host_s < cm->st.host_min_s) cm->st.host_min_s = host_s;
    if (!cm->st.n || dev_ms < cm->st.dev_min_ms) cm->st.dev_min_ms = dev_ms;
    cm->st.n++;
    cm->st.host_s += host_s;
    cm->st.dev_ms += dev_ms;
}

/* Builds every index of the step on the host and uploads them in two copies. */
static int build_indices(cstep *s, ds_err *err) {
    ds_model *m = s->m;
    ds_cuda_model *cm = s->cm;
    const ds_config *c = &m->cfg;
    int n_seq = s->n_seq, T = s->T, D = c->hidden_size;
    int bs = s->pool ? s->pool->block_size : 1;
    /* int arena: ids [T] | seg_off [n_seq+1] | lat_dst [T] | block tables | ctx rows | lg rows */
    size_t ni = (size_t)4 * T + n_seq + 1, nbt = 0, nctx = 0, nlg = 0;
    for (int q = 0; q < n_seq; q++) {
        const ds_seq_batch *sb = &s->seqs[q];
        int ctx = sb->pos0 + sb->n;
        if (m->n_mla) {
            nbt += (size_t)(ctx + bs - 1) / bs;
            if (s->plan->mla_expanded[q]) nctx += (size_t)ctx;
        }
        nlg += (size_t)ds_seq_logit_rows(sb);
    }
    ni += nbt + nctx + nlg;
    int nb_max = ds_model_max_banks(m);
    size_t np = (size_t)4 * m->n_kda * n_seq + (size_t)(nb_max + 1) * (nb_max + 1);
    if (cuda_grow_host((void **)&cm->h_i, &cm->h_icap, ni + 1, sizeof(int32_t), err) ||
        cuda_grow_host((void **)&cm->h_p, &cm->h_pcap, np + 1, sizeof(void *), err) ||
        grow(cm, (void **)&cm->iarena, &cm->icap, ni + 1, sizeof(int32_t), err) ||
        grow(cm, (void **)&cm->parena, &cm->pcap, np + 1, sizeof(void *), err))
        return DS_ERR;
    /* int arena: the regions whose size depends only on the step's shape first, so that a captured
     * graph finds them where it saw them: ids [T] | seg_off [n_seq+1] | lat_dst [T] | tok_bt [T] |
     * tok_pos [T] | lg_rows [n_lg] | block tables | expanded segments' context rows */
    int32_t *hi = cm->h_i;
    size_t seg_at = (size_t)T, lat_at = seg_at + (size_t)n_seq + 1, tokbt_at = lat_at + (size_t)T;
    size_t tokpos_at = tokbt_at + (size_t)T, lg_at = tokpos_at + (size_t)T;
    size_t bt_at = lg_at + nlg, ctx_at = bt_at + nbt, at = ctx_at + nctx;
    for (int q = 0; q < n_seq; q++)
        memcpy(hi + s->off[q], s->seqs[q].tokens, (size_t)s->seqs[q].n * sizeof(int32_t));
    for (int q = 0; q <= n_seq; q++) hi[seg_at + q] = q < n_seq ? s->off[q] : T;
    size_t bt = bt_at, cx = ctx_at;
    s->n_lg = 0;
    for (int q = 0; q < n_seq; q++) {
        const ds_seq_batch *sb = &s->seqs[q];
        s->bt_off[q] = (int)(bt - bt_at);
        s->ctx_off[q] = (int)(cx - ctx_at);
        for (int t = 0; t < sb->n; t++) {
            int p = sb->pos0 + t, r = s->off[q] + t;
            hi[lat_at + r] = m->n_mla ? sb->block_table[p / bs] * bs + p % bs : 0;
            hi[tokbt_at + r] = s->bt_off[q];
            hi[tokpos_at + r] = p;
        }
        for (int i = 0, nl = ds_seq_logit_rows(sb); i < nl; i++)
            hi[lg_at + s->n_lg++] = s->off[q] + sb->n - nl + i;
        if (!m->n_mla) continue;
        int np_q = (sb->pos0 + sb->n + bs - 1) / bs;
        memcpy(hi + bt, sb->block_table, (size_t)np_q * sizeof(int32_t));
        bt += (size_t)np_q;
        if (s->plan->mla_expanded[q])
            for (int p = 0; p < sb->pos0 + sb->n; p++)
                hi[cx++] = sb->block_table[p / bs] * bs + p % bs;
    }
    /* pointer arena: S [n_kda][n_seq] | S_rows [n_kda][n_seq] | tails [n_kda][n_seq] |
     * tail rows [n_kda][n_seq] | cands */
    void **hp = cm->h_p;
    size_t conv_n = ds_model_conv_floats(m), rec_n = ds_model_rec_floats(m);
    s->any_rows = 0;
    for (int j = 0; j < m->n_kda; j++)
        for (int q = 0; q < n_seq; q++) {
            const ds_seq_batch *sb = &s->seqs[q];
            size_t off = (size_t)m->n_kda * conv_n + (size_t)j * rec_n;
            hp[(size_t)j * n_seq + q] = sb->slot + off;
            hp[(size_t)(m->n_kda + j) * n_seq + q] = sb->state_rows ? sb->state_rows + off : NULL;
            s->any_rows |= sb->state_rows != NULL;
            /* the layer's q tail; k's and v's follow it (slot layout, model_impl.h) */
            size_t toff = (size_t)j * conv_n;
            hp[(size_t)(2 * m->n_kda + j) * n_seq + q] = sb->slot + toff;
            hp[(size_t)(3 * m->n_kda + j) * n_seq + q] =
                sb->state_rows ? sb->state_rows + toff : NULL;
        }
    size_t cand_at = (size_t)4 * m->n_kda * n_seq;
    s->nb_max = nb_max;
    int max_ctx = 1;
    for (int q = 0; q < n_seq; q++) max_ctx = DS_MAX(max_ctx, s->seqs[q].pos0 + s->seqs[q].n);
    for (s->ctx_cap = 256; s->ctx_cap < max_ctx; s->ctx_cap *= 2) {
    }
    /* scratch layout: P, x, a, then the banks (see run_layers) */
    size_t TD = (size_t)T * D, TDp = (TD + 15) & ~(size_t)15;
    float *P = cm->sc, *bank = cm->sc + 3 * TDp;
    for (int nb = 0; nb <= nb_max; nb++) {
        void **row = hp + cand_at + (size_t)nb * (nb_max + 1);
        for (int j = 0; j < nb; j++) row[j] = bank + (size_t)j * TDp;
        row[nb] = P;
    }
    if (cm->tune.step_times && ds_cu_step_mark(s->c, 0, err)) return DS_ERR;
    if (ds_cu_upload(s->c, cm->iarena, hi, at * sizeof(int32_t), err) ||
        ds_cu_upload(s->c, cm->parena, hp, np * sizeof(void *), err))
        return DS_ERR;
    s->ids = cm->iarena;
    s->seg_off = cm->iarena + seg_at;
    s->lat_dst = cm->iarena + lat_at;
    s->bt = cm->iarena + bt_at;
    s->ctx_rows = cm->iarena + ctx_at;
    s->lg_rows = cm->iarena + lg_at;
    s->tok_bt = cm->iarena + tokbt_at;
    s->tok_pos = cm->iarena + tokpos_at;
    s->tails = (float *const *)cm->parena + (size_t)2 * m->n_kda * n_seq;
    s->tail_rows = (float *const *)cm->parena + (size_t)3 * m->n_kda * n_seq;
    s->S = (float *const *)cm->parena;
    s->S_rows = (float *const *)cm->parena + (size_t)m->n_kda * n_seq;
    s->cands = (const float *const *)(cm->parena + cand_at);
    return DS_OK;
}

/* Host staging for tensor-parallel collectives that go through the host: at least n floats. */
static float *tp_stage(cstep *s, size_t n, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    if (cuda_grow_host((void **)&cm->tp_host, &cm->tp_cap, n, sizeof(float), err)) return NULL;
    return cm->tp_host;
}

/* dbuf[n] (device) <- its sum over the TP group, as the CPU's tp_sum: through NCCL on the GPUs
 * when the group set it up (attach.c setup_nccl), else through the host and the comm's
 * all-reduce. Nothing on one rank. */
int cuda_tp_sum(cstep *s, float *dbuf, size_t n, ds_err *err) {
    const ds_model *m = s->m;
    if (m->tp_size == 1) return DS_OK;
#ifdef DS_HAVE_NCCL
    if (s->cm->nccl) /* on the stream: no host round trip, and capturable */
        return ds_nccl_allreduce_sum(s->cm->nccl, dbuf, n, ds_cu_stream(s->c), err);
#endif
    float *h = tp_stage(s, n, err);
    if (!h || ds_cu_download(s->c, h, dbuf, n * sizeof(float), err)) return DS_ERR;
    if (m->opts.allreduce(m->opts.allreduce_ctx, h, n))
        return ds_errf(err, "forward: a tensor-parallel all-reduce failed");
    return ds_cu_upload(s->c, dbuf, h, n * sizeof(float), err);
}

/* Copies the stream after `layer` (-1: the embedding) to the segments that asked for it. */
static int save_hidden(cstep *s, int layer, const float *h, ds_err *err) {
    int D = s->m->cfg.hidden_size;
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        size_t rows = (size_t)sb->n * D;
        const float *src = h + (size_t)s->off[q] * D;
        if (sb->hidden && layer >= 0)
            TRY(ds_cu_download(s->c, sb->hidden + (size_t)layer * rows, src, rows * sizeof(float),
                               err));
        for (int j = 0; j < sb->n_taps; j++)
            if (sb->tap_layers[j] == layer)
                TRY(ds_cu_download(s->c, sb->taps + (size_t)j * rows, src, rows * sizeof(float),
                                   err));
    }
    return DS_OK;
}

static int wants_hidden(const cstep *s) {
    for (int q = 0; q < s->n_seq; q++)
        if (s->seqs[q].hidden || s->seqs[q].n_taps) return 1;
    return 0;
}

/* x = rmsnorm(P + a) (a non-NULL: P += a first) or rmsnorm(src) */
static void norm_x(cstep *s, float *x, const float *src, float *P, const float *a, const float *w) {
    const ds_config *c = &s->m->cfg;
    if (a)
        ds_cu_add_rmsnorm(s->c, x, P, a, w, s->T, c->hidden_size, c->rms_norm_eps);
    else
        ds_cu_rmsnorm(s->c, x, src, w, s->T, c->hidden_size, c->rms_norm_eps);
}

/* The step's launches, from the embedding (or the stream that arrived) to the logits in lg: no
 * host synchronisation inside, so that it can be captured as a graph (hidden states and taps,
 * downloaded per layer, are the exception: such steps never are). */
static int run_body(cstep *s, int nb, ds_err *err) {
    ds_model *m = s->m;
    ds_cuda_model *cm = s->cm;
    ds_cu *cu = s->c;
    const ds_config *c = &m->cfg;
    int T = s->T, D = c->hidden_size, N = c->attn_res_block_size;
    size_t TD = (size_t)T * D, TDp = (TD + 15) & ~(size_t)15;
    float *P = s->P, *x = s->x, *a = s->a, *bank = s->bank;
    int hid = wants_hidden(s);
    if (m->l0 == 0) {
        PROF(s, "embed");
        ds_cu_embed_range(cu, P, &cm->embed, s->ids, T, m->v0); /* this rank's vocabulary */
        TRY(cuda_tp_sum(s, P, (size_t)T * D, err));
        if (hid) TRY(save_hidden(s, -1, P, err));
    }
    const int nbx = s->nb_max + 1;
    /* Without AttnRes, each residual add is fused with the norm that reads its result: the FFN's
     * add waits (pending) for the next layer's input norm, or the final norm. */
    int pending = 0;
    for (int i = m->l0; i < m->l1; i++) {
        const layer_w *lw = &m->layers[i];
        const cu_layer *dw = &cm->layers[i];
        PROF(s, "norms, residual, attnres");
        if (N == 0 && pending) {
            norm_x(s, x, NULL, P, a, dw->in_norm);
            pending = 0;
        } else if (N > 0) {
            /* mix first, then bank P: layer 0 banks the embedding (docs/model.md §6.3) */
            TRY(ds_cu_attnres_mix(cu, x, s->cands + (size_t)nb * nbx, nb + 1, dw->attn_res_np, T, D,
                                  c->rms_norm_eps, err));
            int banks = i % N == 0;
            if (banks) TRY(ds_cu_copy_d2d(cu, bank + (size_t)nb++ * TDp, P, TD * 4, err));
            norm_x(s, x, x, NULL, NULL, dw->in_norm);
        } else {
            norm_x(s, x, P, NULL, NULL, dw->in_norm);
        }
        TRY(lw->kind == DS_LAYER_KDA ? cuda_kda_forward(s, lw, &dw->kda, x, a, err)
                                     : cuda_mla_forward(s, lw, &dw->mla, x, a, err));
        PROF(s, "norms, residual, attnres");
        if (N > 0 && i % N == 0)
            TRY(ds_cu_copy_d2d(cu, P, a, TD * 4, err));
        else if (N > 0)
            ds_cu_add(cu, P, a, TD);
        if (N > 0) {
            TRY(ds_cu_attnres_mix(cu, x, s->cands + (size_t)nb * nbx, nb + 1, dw->mlp_res_np, T, D,
                                  c->rms_norm_eps, err));
            norm_x(s, x, x, NULL, NULL, dw->post_norm);
        } else {
            norm_x(s, x, NULL, P, a, dw->post_norm);
        }
        TRY(cuda_ffn_forward(s, &dw->ffn, lw->ffn.is_moe, x, a, err));
        PROF(s, "norms, residual, attnres");
        if (N == 0 && !hid)
            pending = 1; /* P += a happens in the next norm (this stage's or the final one) */
        else
            ds_cu_add(cu, P, a, TD);
        if (hid) TRY(save_hidden(s, i, P, err));
    }
    if (pending && m->l1 < c->num_hidden_layers) ds_cu_add(cu, P, a, TD); /* P goes on whole */
    if (m->l1 < c->num_hidden_layers) return DS_OK; /* the stream and banks go on (run_step) */
    PROF(s, "final norm, lm_head");
    if (N > 0) {
        TRY(ds_cu_attnres_mix(cu, x, s->cands + (size_t)nb * nbx, nb + 1, cm->out_res_np, T, D,
                              c->rms_norm_eps, err));
        ds_cu_rmsnorm(cu, x, x, cm->final_norm, T, D, c->rms_norm_eps);
    } else if (pending) {
        ds_cu_add_rmsnorm(cu, x, P, a, cm->final_norm, T, D, c->rms_norm_eps);
    } else {
        ds_cu_rmsnorm(cu, x, P, cm->final_norm, T, D, c->rms_norm_eps);
    }
    if (s->n_lg) { /* this rank's block of the vocabulary: [n_lg][vp] */
        TRY(ds_cu_move_rows(cu, s->xr, (size_t)D, NULL, x, (size_t)D, s->lg_rows, s->n_lg, D, err));
        TRY(ds_cu_matmul(cu, s->lg, m->vp, s->xr, D, s->n_lg, &cm->lm_head, err));
        /* every row's greedy token, inside the step (and its graph) whether or not a sequence
         * wants it this time: a graph serves steps of the same shape whatever their sampling,
         * and the pass is ~1% of lm_head's (it reads the logits once, from L2 at small batches) */
        if (m->tp_size == 1) {
            PROF(s, "greedy tokens");
            ds_cu_argmax_rows(cu, s->am, s->lg, s->n_lg, m->vp, s->am_parts);
        }
    }
    return DS_OK;
}

/* ---- graphs --------------------------------------------------------------------------------
 * A decode or verify step (every segment short, no per-layer downloads) is replayed from a graph
 * captured the second time its shape is seen (the first runs eagerly, growing every buffer the
 * shape needs, so that the capture allocates nothing). What a step's launches depend on is its
 * key; everything else they read from the index arenas, uploaded before each launch. When any
 * buffer a graph points into moves, every graph is dropped. */
typedef struct graph_key graph_key;
enum { MAX_GRAPHS = 64 };

static int graphable(const cstep *s) {
    const ds_model *m = s->m;
    /* (tensor parallelism through the host cannot be captured; through NCCL it can) */
    if (m->opts.enforce_eager || (m->tp_size > 1 && !s->cm->nccl) || s->T > 1024 || wants_hidden(s))
        return 0;
    for (int q = 0; q < s->n_seq; q++)
        if (s->plan->mla_expanded[q]) return 0;
    return !cuda_kda_chunked_segments(s); /* its chunk table is built on the host per step */
}

void cuda_drop_graphs(ds_cuda_model *cm) {
    for (int i = 0; i < cm->n_graphs; i++) ds_cu_graph_free(cm->graphs[i].g);
    cm->n_graphs = 0;
}

static int run_graphed(cstep *s, int nb_in, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    uint64_t epoch = ds_cu_epoch(s->c) + cm->own_epoch;
    if (epoch != cm->graph_epoch) {
        cuda_drop_graphs(cm);
        cm->graph_epoch = epoch;
    }
    graph_key k = {s->n_seq, s->T, s->n_lg, s->any_rows, s->ctx_cap, nb_in};
    for (int i = 0; i < cm->n_graphs; i++)
        if (!memcmp(&cm->graphs[i].key, &k, sizeof k)) {
            if (!cm->graphs[i].g) return run_body(s, nb_in, err); /* capture failed once */
            cm->graph_replays++;
            return ds_cu_graph_launch(s->c, cm->graphs[i].g, err);
        }
    /* first sight: eagerly (this step's result), then capture the same launches for the next */
    size_t used = s->used;
    TRY(run_body(s, nb_in, err));
    if (ds_cu_epoch(s->c) + cm->own_epoch != epoch) { /* the eager run grew a buffer */
        cuda_drop_graphs(cm);
        cm->graph_epoch = ds_cu_epoch(s->c) + cm->own_epoch;
    }
    if (cm->n_graphs == MAX_GRAPHS) cuda_drop_graphs(cm);
    ds_cu_graph *g = NULL;
    ds_err cap_err;
    s->used = used;
    if (!ds_cu_capture_begin(s->c, &cap_err)) {
        int rc = run_body(s, nb_in, &cap_err);
        ds_cu_graph *got = NULL;
        int rc2 = ds_cu_capture_end(s->c, &got, &cap_err);
        if (!rc && !rc2)
            g = got;
        else
            ds_cu_graph_free(got);
    }
    if (!g) cm->graph_failures++; /* this shape stays eager */
    cm->graphs[cm->n_graphs++] = (struct cu_graph_entry){k, g};
    return DS_OK;
}

static int run_step(cstep *s, const ds_stage_io *in, ds_stage_io *out, ds_err *err) {
    ds_model *m = s->m;
    ds_cuda_model *cm = s->cm;
    ds_cu *cu = s->c;
    const ds_config *c = &m->cfg;
    int T = s->T, D = c->hidden_size, N = c->attn_res_block_size;
    size_t TD = (size_t)T * D, TDp = (TD + 15) & ~(size_t)15;
    /* the buffers that outlive the layers come first, at addresses fixed by the shape */
    s->P = take(s, TD);   /* [T][D] residual stream, or the block-local sum with AttnRes */
    s->x = take(s, TD);   /* [T][D] mixer / FFN input */
    s->a = take(s, TD);   /* [T][D] sublayer output */
    s->bank = take(s, 0); /* [nb_max][T][D] banked AttnRes blocks (build_indices' layout) */
    s->used += (size_t)s->nb_max * TDp;
    s->xr = take(s, (size_t)s->n_lg * D);     /* [n_lg][D] rows that want logits */
    s->lg = take(s, (size_t)s->n_lg * m->vp); /* [n_lg][vp] their logits (this rank's
vocabulary block; all of V on one) */
    s->am_parts = ds_cu_argmax_parts(s->n_lg, m->vp);
    s->am = (uint64_t *)take(s, 2 * (size_t)s->n_lg * s->am_parts); /* (8 bytes: 2 floats) */
    if (s->used > cm->sc_cap) s->overflow = 1;
    TAKEN();
    int nb = 0;
    if (m->l0 > 0) {
        /* a later stage: the stream and the banked blocks arrive from the previous one */
        TRY(ds_cu_upload(cu, s->P, in->h, TD * sizeof(float), err));
        nb = in->n_banks;
        for (int j = 0; j < nb; j++)
            TRY(ds_cu_upload(cu, s->bank + (size_t)j * TDp, in->banks + (size_t)j * TD,
                             TD * sizeof(float), err));
    }
    int nb_out = nb; /* the blocks banked by the end of this stage */
    for (int i = m->l0; N > 0 && i < m->l1; i++) nb_out += i % N == 0;
    if (graphable(s))
        TRY(run_graphed(s, nb, err));
    else
        TRY(run_body(s, nb, err));
    if (cm->tune.step_times) TRY(ds_cu_step_mark(cu, 1, err));
    if (m->l1 < c->num_hidden_layers) { /* not the last stage: hand the stream and the banks on */
        TRY(ds_cu_download(cu, out->h, s->P, TD * sizeof(float), err));
        out->n_banks = nb_out;
        for (int j = 0; j < nb_out; j++)
            TRY(ds_cu_download(cu, out->banks + (size_t)j * TD, s->bank + (size_t)j * TDp,
                               TD * sizeof(float), err));
        return ds_cu_sync(cu, err);
    }
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        if (sb->final_hidden)
            TRY(ds_cu_download(cu, sb->final_hidden, s->x + (size_t)s->off[q] * D,
                               (size_t)sb->n * D * sizeof(float), err));
    }
    int r = 0, V = c->vocab_size;
    if (m->tp_size > 1 && s->n_lg) {
        /* every rank's block, gathered as on the CPU (logits_flush): all [Tp][n_lg][vp] */
        size_t nm = (size_t)s->n_lg * m->vp;
        float *mine = tp_stage(s, nm * (1 + (size_t)m->tp_size), err);
        if (!mine || ds_cu_download(cu, mine, s->lg, nm * sizeof(float), err)) return DS_ERR;
        float *all = mine + nm;
        if (m->opts.allgather(m->opts.allgather_ctx, mine, nm, all))
            return ds_errf(err, "forward: a tensor-parallel all-gather failed");
        TRY(cuda_draw_gathered(s, all, err));
        for (int q = 0; q < s->n_seq; q++) {
            ds_seq_batch *sb = &s->seqs[q];
            for (int i = 0; i < ds_seq_logit_rows(sb); i++, r++) {
                if (sb->argmax && !sb->draws)
                    sb->argmax[i] = ds_argmax_blocks(all + (size_t)r * m->vp,
                                                     (size_t)s->n_lg * m->vp, m->vp, V);
                for (int t = 0; sb->logits && t < m->tp_size; t++) {
                    int v0 = DS_MIN(V, t * m->vp), nv = DS_MIN(V, v0 + m->vp) - v0;
                    memcpy(sb->logits + (size_t)i * V + v0, all + ((size_t)t * s->n_lg + r) * m->vp,
                           (size_t)nv * sizeof(float));
                }
            }
        }
        return ds_cu_sync(cu, err);
    }
    int any_am = 0;
    for (int q = 0; q < s->n_seq; q++) any_am |= s->seqs[q].argmax && s->seqs[q].n_logits;
    uint64_t *keys = NULL; /* [n_lg][am_parts] on the host */
    if (any_am) {          /* the step's greedy tokens (run_body), a few bytes a row to the host */
        const size_t nk = (size_t)s->n_lg * s->am_parts;
        if (!(keys = (uint64_t *)tp_stage(s, 2 * nk, err))) return DS_ERR;
        TRY(ds_cu_download(cu, keys, s->am, nk * sizeof(uint64_t), err));
    }
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        int nl = ds_seq_logit_rows(sb);
        if (sb->logits && nl)
            TRY(ds_cu_download(cu, sb->logits, s->lg + (size_t)r * V,
                               (size_t)nl * V * sizeof(float), err));
        r += nl;
    }
    TRY(cuda_draw_on_device(s, err)); /* after the downloads: the draws edit the rows in place */
    TRY(ds_cu_sync(cu, err));
    r = 0;
    for (int q = 0; keys && q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        int nl = ds_seq_logit_rows(sb);
        for (int i = 0; sb->argmax && !sb->draws && i < nl; i++)
            sb->argmax[i] = ds_cu_argmax_token(keys + (size_t)(r + i) * s->am_parts, s->am_parts);
        r += nl;
    }
    return DS_OK;
}

/* Callers that keep a sequence's KDA slot or verify rows in host memory (the CLI's generate, the

 * pools are device memory already, and pass straight through. host_side [n_seq] marks which. */
static int stage_state(ds_model *m, ds_seq_batch *dev, const ds_seq_batch *seqs, int n_seq,
                       int back, ds_err *err) {
    /* dev starts as a copy of seqs and a staged sequence's pointers are rewritten to the staging
     * buffer, so the way back tells the staged ones by dev != seqs without asking the driver */
    ds_cuda_model *cm = m->be_ctx;
    size_t slot_n = ds_model_slot_floats(m), need = 0;
    if (!slot_n) return DS_OK;
    if (back) {
        for (int q = 0; q < n_seq; q++) {
            if (dev[q].slot != seqs[q].slot)
                TRY(ds_cu_download(cm->c, seqs[q].slot, dev[q].slot, slot_n * sizeof(float), err));
            if (dev[q].state_rows != seqs[q].state_rows)
                TRY(ds_cu_download(cm->c, seqs[q].state_rows, dev[q].state_rows,
                                   (size_t)seqs[q].n * slot_n * sizeof(float), err));
        }
        return DS_OK;
    }
    for (int q = 0; q < n_seq; q++) { /* host pointers: marked NULL in dev until staged */
        if (seqs[q].slot && !ds_cu_is_device_ptr(seqs[q].slot)) {
            need += slot_n;
            dev[q].slot = NULL;
        }
        if (seqs[q].state_rows && !ds_cu_is_device_ptr(seqs[q].state_rows)) {
            need += (size_t)seqs[q].n * slot_n;
            dev[q].state_rows = NULL;
        }
    }
    if (!need) return DS_OK;
    if (grow(cm, (void **)&cm->stage, &cm->stage_cap, need, sizeof(float), err)) return DS_ERR;
    float *at = cm->stage;
    for (int q = 0; q < n_seq; q++) {
        if (seqs[q].slot && !dev[q].slot) {
            TRY(ds_cu_upload(cm->c, at, seqs[q].slot, slot_n * sizeof(float), err));
            dev[q].slot = at;
            at += slot_n;
        }
        if (seqs[q].state_rows && !dev[q].state_rows) { /* written by the step, not read */
            dev[q].state_rows = at;
            at += (size_t)seqs[q].n * slot_n;
        }
    }
    return DS_OK;
}

int cuda_forward(ds_model *m, const ds_step_plan *plan, ds_kv_pool *pool, ds_seq_batch *seqs_in,
                 int n_seq, const ds_stage_io *in, ds_stage_io *out, ds_err *err) {
    ds_cuda_model *cm = m->be_ctx;
    const int *off = plan->off, T = plan->T;
    /* host draws: a TP group's rows are gathered on the host and drawn there (draw.c) */
    if (plan->draws && m->tp_size > 1 && ds_host_draws_space(&cm->draws, m->cfg.vocab_size, err))
        return DS_ERR;
    if (ds_cu_bind(cm->c, err)) return DS_ERR; /* the engine steps in its own thread */
    char *copy_err = cm->dev->copy_err;
    if (copy_err[0]) {
        ds_errf(err, "forward: an earlier state copy on the GPU failed: %.900s", copy_err);
        copy_err[0] = 0;
        return DS_ERR;
    }
    if (m->n_mla && (!pool || !ds_dmem_on_device(pool->dm)))
        return ds_errf(err, "forward: the model is on the GPU but its latent pool is not");
    for (int q = 0; q < n_seq; q++)
        if (m->n_mla && !seqs_in[q].block_table)
            return ds_errf(err, "forward: segment %d has no block table", q);
    for (int q = 0; q < n_seq; q++)
        if (m->n_kda && !seqs_in[q].slot)
            return ds_errf(err, "forward: segment %d has no KDA state slot", q);
    int *hoff = malloc((size_t)2 * (n_seq ? n_seq : 1) * sizeof(int));
    ds_seq_batch *seqs = malloc((size_t)(n_seq ? n_seq : 1) * sizeof *seqs);
    if (!hoff || !seqs) {
        free(hoff);
        free(seqs);
        return ds_errf(err, "forward: out of memory");
    }
    memcpy(seqs, seqs_in, (size_t)n_seq * sizeof *seqs);
    cstep s = {0};
    s.m = m;
    s.cm = cm;
    s.c = cm->c;
    s.plan = plan;
    s.pool = pool;
    s.seqs = seqs;
    s.n_seq = n_seq;
    s.T = T;
    s.off = off;
    s.bt_off = hoff;
    s.ctx_off = hoff + n_seq;
    const double t0 = cm->tune.step_times ? ds_now() : 0.0;
    size_t need = cuda_step_need(m, cm->c, plan, seqs, n_seq, T);
    int rc = grow(cm, (void **)&cm->sc, &cm->sc_cap, need, sizeof(float), err);
    if (!rc) rc = stage_state(m, seqs, seqs_in, n_seq, 0, err);
    if (!rc) rc = build_indices(&s, err);
    if (!rc) rc = run_step(&s, in, out, err);
    if (!rc) ds_cu_prof_step_end(cm->c);
    if (!rc) rc = stage_state(m, seqs, seqs_in, n_seq, 1, err);
    if (!rc && cm->tune.step_times && T == n_seq) /* a decode step: its host and device times */
        cuda_step_times_add(cm, ds_now() - t0, ds_cu_step_mark_ms(cm->c));
    free(hoff);
    free(seqs);
    if (rc) ds_err_prefix(err, "forward on %s", ds_cu_device_name(cm->c));
    return rc;
}
