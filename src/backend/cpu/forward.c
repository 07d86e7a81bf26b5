/* forward.c — the CPU backend (cpu.h): its table of operations and one step of the forward pass
 * (docs/model.md §2–§7).
 *
 * Data flow of one step, top to bottom:
 *   embed -> for each layer: [AttnRes mix] -> RMSNorm -> KDA | MLA -> [AttnRes mix] -> RMSNorm ->
 *   dense MLP | MoE -> ... -> [output AttnRes mix] -> final RMSNorm -> lm_head.
 * All tokens of the step go through each weight in one GEMM (the layers: layers.c); every buffer
 * is cut from one scratch the backend keeps per model, sized before the step by step_need. */
#include "backend/cpu/cpu.h"
#include "backend/cpu/step.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* P[T][D] = the embedding rows of ids[T]. Vocabulary-parallel: each rank writes the rows of the
 * tokens in its block and zeros elsewhere, and the sum over the group is exact (one row's value
 * plus zeros), so every rank ends with the whole embedding, as one process has it. */
static void embed_tokens(step *s, const int32_t *ids, float *P) {
    const ds_model *m = s->m;
    int T = s->T, D = m->cfg.hidden_size;
    if (m->tp_size == 1) {
        ds_embed(P, &m->embed, ids, T);
        return;
    }
    for (int t = 0; t < T; t++) {
        int32_t id = ids[t] - m->v0;
        if (id >= 0 && id < m->nv)
            ds_embed(P + (size_t)t * D, &m->embed, &id, 1);
        else
            memset(P + (size_t)t * D, 0, (size_t)D * sizeof(float));
    }
    cpu_tp_sum(s, P, (size_t)T * D);
}

/* Rows of logits computed per lm_head matmul: the rows of every segment that asks for logits are
 * gathered, so one matmul streams the V x D weights once for up to LG_CHUNK tokens (one matmul per
 * sequence streamed all of them for every decode token: at V = 65536 that was most of a decode
 * step). The matmul gives each row the same bits whatever else is in its batch. */
enum { LG_CHUNK = 32 };

/* Writes chunk rows mine[n][vp] (this rank's vocabulary block) to their segments' logits dst[n]
 * [V], their greedy tokens or draws *am[n] (either NULL where not wanted; dr[j] non-NULL: drawn);
 * vocabulary-parallel, the blocks of every rank are all-gathered first. */
static void logits_flush(step *s, int n, float *mine, float *all, float **dst, int32_t **am,
                         const ds_row_draw **dr) {
    const ds_model *m = s->m;
    int V = m->cfg.vocab_size, Tp = m->tp_size, vp = m->vp, nd = 0;
    for (int j = 0; j < n; j++) nd += dr[j] != NULL;
    if (nd) ds_model_draw_wait(m); /* the draws' masks are complete from here */
    if (Tp == 1) {
        for (int j = 0; j < n; j++) {
            if (dst[j]) memcpy(dst[j], mine + (size_t)j * vp, (size_t)V * sizeof(float));
            if (am[j] && !dr[j]) *am[j] = ds_argmax(mine + (size_t)j * vp, V);
        }
        if (nd) ds_host_draws_run(&s->ctx->draws, V, mine, 0, vp, n, dr, am);
        return;
    }
    if (!s->tp_failed && m->opts.allgather(m->opts.allgather_ctx, mine, (size_t)n * vp, all))
        s->tp_failed = 1;
    for (int j = 0; j < n; j++) {
        if (am[j] && !dr[j]) *am[j] = ds_argmax_blocks(all + (size_t)j * vp, (size_t)n * vp, vp, V);
        for (int t = 0; dst[j] && t < Tp; t++) {
            int v0 = DS_MIN(V, t * vp), nv = DS_MIN(V, v0 + vp) - v0;
            memcpy(dst[j] + v0, all + ((size_t)t * n + j) * vp, (size_t)nv * sizeof(float));
        }
    }
    if (nd) ds_host_draws_run(&s->ctx->draws, V, all, (size_t)n * vp, vp, n, dr, am);
}

/* The logits every segment asked for (its last n_logits rows of x [T][D]). Vocabulary-parallel,
 * each rank computes its block of V and the blocks are all-gathered: each logit is the same dot
 * product one process computes, so the result is identical. The ranks of a TP group see the same
 * segments, so they flush the same chunks. */
static void compute_logits(step *s, const float *x) {
    const ds_model *m = s->m;
    int V = m->cfg.vocab_size, D = m->cfg.hidden_size, Tp = m->tp_size, vp = m->vp;
    float *xr = sc_take(&s->sc, (size_t)LG_CHUNK * D);    /* [LG_CHUNK][D] gathered rows */
    float *mine = sc_take(&s->sc, (size_t)LG_CHUNK * vp); /* [LG_CHUNK][vp] */
    float *all = Tp > 1 ? sc_take(&s->sc, (size_t)Tp * LG_CHUNK * vp) : NULL; /* [Tp][n][vp] */
    if (s->sc.overflow) return;
    float *dst[LG_CHUNK];
    int32_t *am[LG_CHUNK];
    const ds_row_draw *dr[LG_CHUNK];
    int n = 0;
    for (int q = 0; q < s->n_seq; q++) {
        const ds_seq_batch *sb = &s->seqs[q];
        int nl = ds_seq_logit_rows(sb);
        for (int i = 0; i < nl; i++) {
            memcpy(xr + (size_t)n * D, x + (size_t)(s->off[q] + sb->n - nl + i) * D,
                   (size_t)D * sizeof(float));
            dst[n] = sb->logits ? sb->logits + (size_t)i * V : NULL;
            dr[n] = sb->argmax && sb->draws ? sb->draws + i : NULL;
            am[n++] = sb->argmax ? sb->argmax + i : NULL;
            if (n == LG_CHUNK) {
                ds_matmul(mine, vp, xr, D, n, &m->lm_head);
                logits_flush(s, n, mine, all, dst, am, dr);
                n = 0;
            }
        }
    }
    if (n) {
        ds_matmul(mine, vp, xr, D, n, &m->lm_head);
        logits_flush(s, n, mine, all, dst, am, dr);
    }
}

/* Copies the stream after `layer` (-1: the embedding) to the segments that asked for it. */
static void save_hidden(step *s, int layer, const float *h) {
    int D = s->m->cfg.hidden_size;
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        size_t rows = (size_t)sb->n * D;
        const float *src = h + (size_t)s->off[q] * D;
        if (sb->hidden && layer >= 0)
            memcpy(sb->hidden + (size_t)layer * rows, src, rows * sizeof(float));
        for (int j = 0; j < sb->n_taps; j++)
            if (sb->tap_layers[j] == layer)
                memcpy(sb->taps + (size_t)j * rows, src, rows * sizeof(float));
    }
}

/* Runs the whole step; returns the scratch floats it needed (0 when the buffer was enough). */
static size_t run_step(step *s) {
    ds_model *m = s->m;
    const ds_config *c = &m->cfg;
    int T = s->T, D = c->hidden_size, L = c->num_hidden_layers, N = c->attn_res_block_size;
    size_t TD = (size_t)T * D;
    s->sc = (scratch){s->ctx->scratch, s->ctx->scratch_cap, 0, 0, 0};
    scratch *sc = &s->sc;
    int n_banks_max = N > 0 ? (L + N - 1) / N + 1 : 0;
    int32_t *ids = (int32_t *)sc_take(sc, (size_t)T); /* [T] */
    float *P = sc_take(sc, TD); /* [T][D] residual stream, or the block-local sum with AttnRes */
    float *x = sc_take(sc, TD); /* [T][D] mixer / FFN input */
    float *a = sc_take(sc, TD); /* [T][D] sublayer output */
    float *bank = n_banks_max ? sc_take(sc, (size_t)n_banks_max * TD) : NULL; /* [nb][T][D] */
    const float **cands = calloc((size_t)n_banks_max + 2, sizeof *cands);
    if (sc->overflow || !cands) {
        free(cands);
        return sc->need + 1;
    }
    int nb = 0; /* banked AttnRes blocks */
    if (m->l0 == 0) {
        for (int q = 0; q < s->n_seq; q++)
            memcpy(ids + s->off[q], s->seqs[q].tokens, (size_t)s->seqs[q].n * sizeof(int32_t));
        embed_tokens(s, ids, P);
        save_hidden(s, -1, P);
    } else {
        /* A later pipeline stage: the stream and the banked blocks arrive from the previous one
         * (docs/model.md §6.4) — a block opened there may close here. */
        memcpy(P, s->in->h, TD * sizeof(float));
        nb = s->in->n_banks;
        if (nb) memcpy(bank, s->in->banks, (size_t)nb * TD * sizeof(float));
    }
    for (int i = m->l0; i < m->l1 && !sc->overflow; i++) {
        const layer_w *lw = &m->layers[i];
        if (N > 0) {
            /* Mix first, then bank P: layer 0 banks the embedding (docs/model.md §6.3, trap 13). */
            for (int j = 0; j < nb; j++) cands[j] = bank + (size_t)j * TD;
            cands[nb] = P;
            ds_attnres_mix(x, cands, nb + 1, lw->attn_res_np, T, D, c->rms_norm_eps);
            int banks = i % N == 0;
            if (banks) memcpy(bank + (size_t)nb++ * TD, P, TD * sizeof(float));
            ds_rmsnorm(x, x, lw->in_norm, T, D, c->rms_norm_eps);
            if (lw->kind == DS_LAYER_KDA)
                cpu_kda_forward(s, lw, x, a);
            else
                cpu_mla_forward(s, lw, x, a);
            if (banks)
                memcpy(P, a, TD * sizeof(float));
            else
                ds_add(P, a, TD);
            for (int j = 0; j < nb; j++) cands[j] = bank + (size_t)j * TD;
            cands[nb] = P;
            ds_attnres_mix(x, cands, nb + 1, lw->mlp_res_np, T, D, c->rms_norm_eps);
            ds_rmsnorm(x, x, lw->post_norm, T, D, c->rms_norm_eps);
            cpu_ffn_forward(s, lw, x, a);
            ds_add(P, a, TD);
        } else {
            ds_rmsnorm(x, P, lw->in_norm, T, D, c->rms_norm_eps);
            if (lw->kind == DS_LAYER_KDA)
                cpu_kda_forward(s, lw, x, a);
            else
                cpu_mla_forward(s, lw, x, a);
            ds_add(P, a, TD);
            ds_rmsnorm(x, P, lw->post_norm, T, D, c->rms_norm_eps);
            cpu_ffn_forward(s, lw, x, a);
            ds_add(P, a, TD);
        }
        save_hidden(s, i, P);
    }
    if (sc->overflow) {
        free(cands);
        return sc->need + 1;
    }
    if (m->l1 < L) { /* not the last stage: hand the stream and the banks on */
        memcpy(s->out->h, P, TD * sizeof(float));
        s->out->n_banks = nb;
        if (nb) memcpy(s->out->banks, bank, (size_t)nb * TD * sizeof(float));
        free(cands);
        return 0;
    }
    if (N > 0) {
        for (int j = 0; j < nb; j++) cands[j] = bank + (size_t)j * TD;
        cands[nb] = P;
        ds_attnres_mix(x, cands, nb + 1, m->out_res_np, T, D, c->rms_norm_eps);
        ds_rmsnorm(x, x, m->final_norm, T, D, c->rms_norm_eps);
    } else {
        ds_rmsnorm(x, P, m->final_norm, T, D, c->rms_norm_eps);
    }
    free(cands);
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        const float *xs = x + (size_t)s->off[q] * D;
        if (sb->final_hidden) memcpy(sb->final_hidden, xs, (size_t)sb->n * D * sizeof(float));
    }
    compute_logits(s, x);
    if (sc->overflow) return sc->need + 1;
    return 0;
}

/* Upper bound, in floats, of the scratch one step takes (mirrors the sc_take calls above; every
 * take is counted with 16 floats of alignment slack). */
static size_t step_need(const step *s) {
    const ds_config *c = &s->m->cfg;
    size_t T = (size_t)s->T, D = (size_t)c->hidden_size, L = (size_t)c->num_hidden_layers;
    size_t N = (size_t)c->attn_res_block_size, pad = 16;
    size_t base = T + 3 * T * D + (N ? ((L + N - 1) / N + 1) * T * D : 0) + 5 * pad;
    size_t H = (size_t)c->kda_num_heads, dk = (size_t)c->kda_head_dim, P = H * dk;
    size_t kda = c->num_kda_layers ? 7 * T * P + T * dk + T * H + 8 * pad : 0;
    size_t rows_max = 0; /* speculative state rows (see kda_forward) */
    for (int q = 0; q < s->n_seq; q++)
        if (s->seqs[q].state_rows)
            rows_max = DS_MAX(rows_max, (size_t)s->seqs[q].n * H * dk * dk +
                                            (size_t)(c->short_conv_kernel_size - 1) * P + 2 * pad);
    if (kda) kda += rows_max;
    size_t mla = 0;
    if (c->num_mla_layers) {
        size_t Ha = (size_t)c->num_attention_heads, R = (size_t)c->kv_lora_rank;
        size_t dn = (size_t)c->qk_nope_head_dim, dr = (size_t)c->qk_rope_head_dim;
        size_t dvh = (size_t)c->v_head_dim;
        size_t seg = 0;
        for (int q = 0; q < s->n_seq; q++) {
            size_t ctx = (size_t)s->seqs[q].pos0 + (size_t)s->seqs[q].n;
            seg = DS_MAX(seg, ctx * (R + dr + 2 * Ha * (dn + dvh)) + 5 * pad); /* expanded */
        }
        seg = DS_MAX(seg, T * Ha * (dr + 2 * R) + 3 * pad); /* one absorbed run */
        mla = T * Ha * (dn + dr) + T * (R + dr) + T * Ha * dvh + T * (size_t)c->q_lora_rank +
              4 * pad + seg;
    }
    size_t ffn = 2 * T * (size_t)c->intermediate_size + 2 * pad;
    if (c->num_experts) {
        size_t E = (size_t)c->num_experts, K = (size_t)c->num_experts_per_token;
        size_t Hin = c->routed_expert_hidden_size ? (size_t)c->routed_expert_hidden_size : D;
        size_t Ie = (size_t)c->moe_intermediate_size, Is = Ie * (size_t)c->num_shared_experts;
        size_t moe = T * E + 2 * T * K + 4 * T * Hin + 2 * T + 9 * pad;
        moe += DS_MAX(2 * T * Ie + 2 * pad, T * D + pad + 2 * T * Is + 2 * pad);
        ffn = DS_MAX(ffn, moe);
    }
    size_t lg = 0; /* the logits chunk (see compute_logits) */
    if (s->m->l1 == (int)L) {
        size_t vp = (size_t)s->m->vp, Tp = (size_t)s->m->tp_size;
        lg = LG_CHUNK * (D + vp + (Tp > 1 ? Tp * vp : 0)) + 3 * pad;
    }
    return base + DS_MAX(DS_MAX(DS_MAX(kda, mla), ffn), lg);
}

/* ---- the operations ---------------------------------------------------------------------------
 */

static int cpu_available(void) {
    return 1;
}

static int cpu_attach(ds_model *m, int device_index, ds_err *err) {
    (void)device_index;
    cpu_ctx *ctx = ds_calloc(1, sizeof *ctx, err);
    if (!ctx) return DS_ERR;
    m->be_ctx = ctx;
    return DS_OK;
}

static void cpu_detach(ds_model *m) {
    cpu_ctx *ctx = m->be_ctx;
    if (!ctx) return;
    free(ctx->scratch);
    ds_host_draws_free(&ctx->draws);
    free(ctx);
    m->be_ctx = NULL;
}

static int cpu_forward(ds_model *m, const ds_step_plan *plan, ds_kv_pool *pool, ds_seq_batch *seqs,
                       int n_seq, const ds_stage_io *in, ds_stage_io *out, ds_err *err) {
    cpu_ctx *ctx = m->be_ctx;
    if (plan->draws && ds_host_draws_space(&ctx->draws, m->cfg.vocab_size, err)) return DS_ERR;
    step s = {m, ctx, plan, pool, seqs, n_seq, plan->T, plan->off, in, out, {0}, 0};
    size_t need = step_need(&s);
    if (need > ctx->scratch_cap) {
        free(ctx->scratch);
        ctx->scratch = ds_aligned_alloc(need * sizeof(float), err);
        ctx->scratch_cap = ctx->scratch ? need : 0;
        if (!ctx->scratch) return DS_ERR;
    }
    size_t short_by = run_step(&s);
    if (short_by)
        return ds_errf(err, "forward: internal error: scratch estimate %zu floats, step took %zu",
                       need, short_by - 1);
    if (s.tp_failed) return ds_errf(err, "forward: a tensor-parallel all-reduce failed");
    return DS_OK;
}

static size_t cpu_mem_free(const ds_model *m) {
    (void)m;
    return 0;
}

/* (asked each time: tests switch the kernels' instruction set between steps) */
static const char *cpu_device_name(const ds_model *m) {
    cpu_ctx *ctx = m->be_ctx;
    snprintf(ctx->name, sizeof ctx->name, "cpu (%s)", ds_isa_name(ds_kernels_isa()));
    return ctx->name;
}

static int cpu_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    (void)m, (void)copy_gbs, (void)gemm_tflops;
    return ds_errf(err, "device limits: the model runs on the CPU");
}

static void cpu_profile_report(const ds_model *m, FILE *f, const char *title) {
    (void)m, (void)f, (void)title; /* the CPU keeps no per-op profile */
}

static double cpu_profile_gemm_tflops(const ds_model *m, double *ms_per_step) {
    (void)m, (void)ms_per_step;
    return 0;
}

/* (no draft entries: the draft runs on the host, model_draft.c) */
const ds_backend_ops ds_cpu_backend = {
    .name = "cpu",
    .device_memory = 0,
    .available = cpu_available,
    .attach = cpu_attach,
    .detach = cpu_detach,
    .forward = cpu_forward,
    .mem_free = cpu_mem_free,
    .device_name = cpu_device_name,
    .limits = cpu_limits,
    .profile_report = cpu_profile_report,
    .profile_gemm_tflops = cpu_profile_gemm_tflops,
};
