/* layers.c — the CPU backend's layers: KDA (short convs, the gated delta rule in its recurrent
 * or chunked form), MLA (absorbed runs of short segments, expanded long ones, over the paged
 * latent pool) and the feed-forward blocks (dense MLP, MoE with shared and latent experts). All
 * tokens of the step go through each weight in one GEMM; the per-sequence work (conv tails, the
 * recurrence, attention) runs segment by segment, each on its own state. */
#include "backend/cpu/step.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float *slot_conv(const step *s, int q, int kda_idx) {
    return s->seqs[q].slot + (size_t)kda_idx * ds_model_conv_floats(s->m);
}
static float *slot_rec(const step *s, int q, int kda_idx) {
    return s->seqs[q].slot + (size_t)s->m->n_kda * ds_model_conv_floats(s->m) +
           (size_t)kda_idx * ds_model_rec_floats(s->m);
}

/* out[T][D] = KDA(xn[T][D]) (docs/model.md §3). */
void cpu_kda_forward(step *s, const layer_w *lw, const float *xn, float *out) {
    const ds_config *c = &s->m->cfg;
    const kda_w *w = &lw->kda;
    int T = s->T, D = c->hidden_size, H = s->m->Hk, dk = c->kda_head_dim, P = H * dk;
    int W = c->short_conv_kernel_size;
    scratch *sc = &s->sc;
    size_t mark = sc->used;
    float *pre = sc_take(sc, (size_t)T * P);  /* [T][P] pre-conv projection */
    float *q = sc_take(sc, (size_t)T * P);    /* [T][H][dk] */
    float *k = sc_take(sc, (size_t)T * P);    /* [T][H][dk] */
    float *v = sc_take(sc, (size_t)T * P);    /* [T][H][dv] */
    float *fa = sc_take(sc, (size_t)T * dk);  /* [T][dk] */
    float *g = sc_take(sc, (size_t)T * P);    /* [T][H][dk] log decay, then reused for the gate */
    float *beta = sc_take(sc, (size_t)T * H); /* [T][H] */
    float *o = sc_take(sc, (size_t)T * P);    /* [T][H][dv] */
    if (sc->overflow) return;
    const ds_mat *proj[3] = {&w->q, &w->k, &w->v};
    const float *conv_w[3] = {w->q_conv, w->k_conv, w->v_conv};
    float *dst[3] = {q, k, v};
    size_t slot_n = ds_model_slot_floats(s->m), tail_n = (size_t)(W - 1) * P;
    for (int j = 0; j < 3; j++) {
        ds_matmul(pre, P, xn, D, T, proj[j]);
        for (int qi = 0; qi < s->n_seq; qi++) {
            const ds_seq_batch *sb = &s->seqs[qi];
            float *tail = slot_conv(s, qi, lw->kind_idx) + (size_t)j * tail_n;
            size_t r = (size_t)s->off[qi] * P;
            float *old = NULL; /* [W-1][P] the tail before this step */
            if (sb->state_rows) {
                old = sc_take(sc, tail_n);
                if (sc->overflow) return;
                memcpy(old, tail, tail_n * sizeof(float));
            }
            ds_short_conv_silu(dst[j] + r, pre + r, sb->n, P, conv_w[j], W, tail);
            /* The tail after token t is rows t-W+2 .. t of (old tail ++ this step's inputs). */
            for (int t = 0; old && t < sb->n; t++) {
                float *dstrow = sb->state_rows + (size_t)t * slot_n + (size_t)(tail - sb->slot);
                for (int i = 0; i < W - 1; i++) {
                    int u = t - (W - 1) + 1 + i;
                    const float *src =
                        u < 0 ? old + (size_t)(u + W - 1) * P : pre + r + (size_t)u * P;
                    memcpy(dstrow + (size_t)i * P, src, (size_t)P * sizeof(float));
                }
            }
            if (old) sc->used -= (tail_n + 15) & ~(size_t)15;
        }
    }
    ds_l2norm_heads(q, T, H, dk, 1e-6f, 1.0f / sqrtf((float)dk));
    ds_l2norm_heads(k, T, H, dk, 1e-6f, 1.0f);
    ds_matmul(fa, dk, xn, D, T, &w->f_a);
    ds_matmul(pre, P, fa, dk, T, &w->f_b);
    ds_kda_gate(g, pre, T, H, dk, w->A_log, w->dt_bias, c->has_gate_lower_bound,
                c->gate_lower_bound);
    ds_matmul(beta, H, xn, D, T, &w->b);
    ds_sigmoid_inplace(beta, (size_t)T * H);
    for (int qi = 0; qi < s->n_seq; qi++) {
        int n = s->seqs[qi].n;
        size_t r = (size_t)s->off[qi] * P;
        float *S = slot_rec(s, qi, lw->kind_idx);
        const ds_seq_batch *sb = &s->seqs[qi];
        if (sb->state_rows) {
            size_t rec_n = (size_t)H * dk * dk;
            float *rows = sc_take(sc, (size_t)n * rec_n); /* [n][H][dk][dv] */
            if (sc->overflow) return;
            ds_kda_recurrent(o + r, q + r, k + r, v + r, g + r, beta + (size_t)s->off[qi] * H, S,
                             rows, n, H, dk, dk);
            for (int t = 0; t < n; t++)
                memcpy(sb->state_rows + (size_t)t * slot_n + (size_t)(S - sb->slot),
                       rows + (size_t)t * rec_n, rec_n * sizeof(float));
            sc->used -= ((size_t)n * rec_n + 15) & ~(size_t)15;
        } else if (s->plan->kda_chunked[qi])
            ds_kda_chunked(o + r, q + r, k + r, v + r, g + r, beta + (size_t)s->off[qi] * H, S, n,
                           H, dk, dk, s->m->opts.kda_chunk);
        else
            ds_kda_recurrent(o + r, q + r, k + r, v + r, g + r, beta + (size_t)s->off[qi] * H, S,
                             NULL, n, H, dk, dk);
    }
    /* output gate logits into g (no longer needed as decay) */
    if (c->use_full_rank_gate) {
        ds_matmul(g, P, xn, D, T, &w->g);
    } else {
        ds_matmul(fa, dk, xn, D, T, &w->g_a);
        ds_matmul(g, P, fa, dk, T, &w->g_b);
    }
    ds_gated_rmsnorm_heads(q, o, g, w->o_norm, T, H, dk, c->rms_norm_eps);
    ds_matmul(out, D, q, P, T, &w->o);
    cpu_tp_sum(s, out, (size_t)T * D);
    sc->used = mark;
}

/* out[T][D] = MLA(xn[T][D]) (docs/model.md §4); writes this step's latent rows into the pool. */
void cpu_mla_forward(step *s, const layer_w *lw, const float *xn, float *out) {
    const ds_config *c = &s->m->cfg;
    const mla_w *w = &lw->mla;
    int T = s->T, D = c->hidden_size, Ha = s->m->Ha, R = c->kv_lora_rank;
    int dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dvh = c->v_head_dim, dq = dn + dr;
    int row = R + dr;
    scratch *sc = &s->sc;
    size_t mark = sc->used;
    float *q = sc_take(sc, (size_t)T * Ha * dq);  /* [T][Ha][dn+dr] */
    float *kv = sc_take(sc, (size_t)T * row);     /* [T][R+dr] this step's latent rows */
    float *o = sc_take(sc, (size_t)T * Ha * dvh); /* [T][Ha][dvh] */
    float *qa = c->q_lora_rank ? sc_take(sc, (size_t)T * c->q_lora_rank) : NULL; /* [T][Rq] */
    if (sc->overflow) return;
    if (c->q_lora_rank) {
        ds_matmul(qa, c->q_lora_rank, xn, D, T, &w->q_a);
        ds_rmsnorm(qa, qa, w->q_a_norm, T, c->q_lora_rank, 1e-6f);
        ds_matmul(q, Ha * dq, qa, c->q_lora_rank, T, &w->q_b);
    } else {
        ds_matmul(q, Ha * dq, xn, D, T, &w->q);
    }
    ds_matmul(kv, row, xn, D, T, &w->kv_a);
    for (int t = 0; t < T; t++)
        ds_rmsnorm(kv + (size_t)t * row, kv + (size_t)t * row, w->kv_a_norm, 1, R, 1e-6f);
    /* the pool's rows, f32, FP8 or BF16: every attention below reads them as stored, this step's
     * own rows included (docs/quantization.md §4) */
    ds_latent_view view = {
        s->pool->layer[lw->kind_idx], NULL, s->pool->block_size, row, R, s->pool->kv_dtype};
    float scale = 1.0f / sqrtf((float)dq);
    for (int qi = 0; qi < s->n_seq; qi++) {
        const ds_seq_batch *sb = &s->seqs[qi];
        view.block_table = sb->block_table;
        for (int t = 0; t < sb->n; t++)
            ds_latent_store(&view, sb->pos0 + t, kv + (size_t)(s->off[qi] + t) * row);
    }
    /* Short segments (decodes, verifies) use the absorbed form. Consecutive ones form a run whose
     * query absorption and value up-projection are one GEMM per head over all its rows; only the
     * attention itself is per sequence. Per-row results do not depend on the run's size. */
    int run0 = -1; /* first segment of the open run */
    for (int qi = 0; qi <= s->n_seq; qi++) {
        int expanded = qi < s->n_seq && s->plan->mla_expanded[qi];
        if (run0 >= 0 && (qi == s->n_seq || expanded)) {
            int r_start = s->off[run0], Tr = s->off[qi - 1] + s->seqs[qi - 1].n - r_start;
            size_t m2 = sc->used;
            float *qr = sc_take(sc, (size_t)Tr * Ha * dr);  /* [Tr][Ha][dr] */
            float *qbar = sc_take(sc, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            float *obar = sc_take(sc, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            if (sc->overflow) return;
            const float *qs = q + (size_t)r_start * Ha * dq;
            for (int t = 0; t < Tr; t++)
                for (int h = 0; h < Ha; h++)
                    memcpy(qr + ((size_t)t * Ha + h) * dr, qs + ((size_t)t * Ha + h) * dq + dn,
                           (size_t)dr * sizeof(float));
            for (int h = 0; h < Ha; h++) { /* q̄_h = W_UK_h^T qN_h (docs/model.md §4.4) */
                ds_mat uk = ds_mat_rows(&w->kv_b, h * (dn + dvh), dn);
                ds_matmul_t(qbar + (size_t)h * R, Ha * R, qs + (size_t)h * dq, Ha * dq, Tr, &uk);
            }
            for (int qj = run0; qj < qi; qj++) {
                const ds_seq_batch *sb = &s->seqs[qj];
                size_t at = (size_t)(s->off[qj] - r_start) * Ha;
                view.block_table = sb->block_table;
                ds_mla_attend_absorbed(obar + at * R, qbar + at * R, qr + at * dr, sb->n, Ha, R, dr,
                                       &view, sb->pos0, sb->pos0 + sb->n, 1, scale);
            }
            float *os = o + (size_t)r_start * Ha * dvh;
            for (int h = 0; h < Ha; h++) { /* o_h = W_UV_h ō_h */
                ds_mat uv = ds_mat_rows(&w->kv_b, h * (dn + dvh) + dn, dvh);
                ds_matmul(os + (size_t)h * dvh, Ha * dvh, obar + (size_t)h * R, Ha * R, Tr, &uv);
            }
            sc->used = m2;
            run0 = -1;
        }
        if (qi == s->n_seq) break;
        if (!expanded) {
            if (run0 < 0) run0 = qi;
            continue;
        }
        /* Expanded form: up-project every context latent once for this segment. */
        const ds_seq_batch *sb = &s->seqs[qi];
        int n = sb->n, pos0 = sb->pos0, ctx = pos0 + n, r0 = s->off[qi];
        view.block_table = sb->block_table;
        const float *qs = q + (size_t)r0 * Ha * dq;
        float *os = o + (size_t)r0 * Ha * dvh;
        size_t m2 = sc->used;
        float *cl = sc_take(sc, (size_t)ctx * R);                /* [ctx][R] */
        float *kr = sc_take(sc, (size_t)ctx * dr);               /* [ctx][dr] */
        float *kvb = sc_take(sc, (size_t)ctx * Ha * (dn + dvh)); /* [ctx][Ha][dn+dvh] */
        float *kn = sc_take(sc, (size_t)ctx * Ha * dn);          /* [ctx][Ha][dn] */
        float *vv = sc_take(sc, (size_t)ctx * Ha * dvh);         /* [ctx][Ha][dvh] */
        if (sc->overflow) return;
        for (int t = 0; t < ctx; t++)
            ds_latent_load(&view, t, cl + (size_t)t * R, kr + (size_t)t * dr);
        ds_matmul(kvb, Ha * (dn + dvh), cl, R, ctx, &w->kv_b);
        for (int t = 0; t < ctx; t++)
            for (int h = 0; h < Ha; h++) {
                const float *src = kvb + ((size_t)t * Ha + h) * (dn + dvh);
                memcpy(kn + ((size_t)t * Ha + h) * dn, src, (size_t)dn * sizeof(float));
                memcpy(vv + ((size_t)t * Ha + h) * dvh, src + dn, (size_t)dvh * sizeof(float));
            }
        ds_mla_attend_expanded(os, qs, kn, kr, vv, n, ctx, Ha, dn, dr, dvh, pos0, 1, scale);
        sc->used = m2;
    }
    if (c->mla_use_output_gate) {
        float *gt = q; /* reuse: [T][Ha*dvh] fits in [T][Ha*dq] */
        ds_matmul(gt, Ha * dvh, xn, D, T, &w->g);
        ds_sigmoid_inplace(gt, (size_t)T * Ha * dvh);
        for (size_t i = 0; i < (size_t)T * Ha * dvh; i++) o[i] *= gt[i];
    }
    ds_matmul(out, D, o, Ha * dvh, T, &w->o);
    cpu_tp_sum(s, out, (size_t)T * D);
    sc->used = mark;
}

static void act(const ds_config *c, float *out, const float *gate, const float *up, size_t n) {
    if (c->hidden_act == DS_ACT_SITU)
        ds_act_situ(out, gate, up, n, c->situ_beta, c->situ_linear_beta);
    else
        ds_act_swiglu(out, gate, up, n);
}

/* y[T][D] = W_down act(W_gate x, W_up x) — dense MLP and shared experts. */
static void mlp(step *s, const ds_mat *gate, const ds_mat *up, const ds_mat *down, const float *x,
                int T, float *y) {
    const ds_config *c = &s->m->cfg;
    int D = gate->cols, I = gate->rows;
    size_t mark = s->sc.used;
    float *a = sc_take(&s->sc, (size_t)T * I); /* [T][I] */
    float *b = sc_take(&s->sc, (size_t)T * I); /* [T][I] */
    if (s->sc.overflow) return;
    ds_matmul(a, I, x, D, T, gate);
    ds_matmul(b, I, x, D, T, up);
    act(c, a, a, b, (size_t)T * I);
    ds_matmul(y, down->rows, a, I, T, down);
    s->sc.used = mark;
}

/* out[T][D] = FFN(xn[T][D]) (docs/model.md §5). */
void cpu_ffn_forward(step *s, const layer_w *lw, const float *xn, float *out) {
    const ds_config *c = &s->m->cfg;
    const ffn_w *w = &lw->ffn;
    int T = s->T, D = c->hidden_size;
    if (!w->is_moe) {
        mlp(s, &w->gate, &w->up, &w->down, xn, T, out);
        cpu_tp_sum(s, out, (size_t)T * D);
        return;
    }
    int E = c->num_experts, K = c->num_experts_per_token;
    int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : D;
    scratch *sc = &s->sc;
    size_t mark = sc->used;
    float *z = sc_take(sc, (size_t)T * E);                /* [T][E] router logits */
    float *wt = sc_take(sc, (size_t)T * K);               /* [T][K] combine weights */
    int32_t *idx = (int32_t *)sc_take(sc, (size_t)T * K); /* [T][K] chosen experts */
    float *u = sc_take(sc, (size_t)T * Hin);              /* [T][Hin] expert input */
    float *acc = sc_take(sc, (size_t)T * Hin);            /* [T][Hin] weighted expert sum */
    float *xe = sc_take(sc, (size_t)T * Hin);             /* [Te][Hin] gathered rows */
    float *ye = sc_take(sc, (size_t)T * Hin);             /* [Te][Hin] expert outputs */
    int32_t *rows = (int32_t *)sc_take(sc, (size_t)T);    /* [Te] token of each gathered row */
    float *rw = sc_take(sc, (size_t)T);                   /* [Te] its combine weight */
    if (sc->overflow) return;
    ds_matmul(z, E, xn, D, T, &w->router);
    for (int t = 0; t < T; t++)
        ds_moe_route(idx + (size_t)t * K, wt + (size_t)t * K, z + (size_t)t * E, w->router_bias, E,
                     K, c->use_grouped_topk ? c->num_expert_group : 1, c->topk_group,
                     c->moe_renormalize, c->routed_scaling_factor, s->m->opts.hf_kl_router_quirk);
    if (c->routed_expert_hidden_size)
        ds_matmul(u, Hin, xn, D, T, &w->lat_down);
    else
        memcpy(u, xn, (size_t)T * D * sizeof(float));
    memset(acc, 0, (size_t)T * Hin * sizeof(float));
    /* Experts in id order: a token's sum is accumulated in ascending expert id whatever else is
     * in the batch, so its result does not depend on its neighbours. Under tensor parallelism
     * each rank sums its own experts [e0, e1) and the all-reduce below adds the ranks' sums. */
    for (int e = s->m->e0; e < s->m->e1; e++) {
        int Te = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                if (idx[(size_t)t * K + j] == e) {
                    rows[Te] = t;
                    rw[Te] = wt[(size_t)t * K + j];
                    memcpy(xe + (size_t)Te * Hin, u + (size_t)t * Hin, (size_t)Hin * sizeof(float));
                    Te++;
                }
        if (!Te) continue;
        mlp(s, &w->w1[e], &w->w3[e], &w->w2[e], xe, Te, ye);
        for (int r = 0; r < Te; r++)
            ds_axpy(acc + (size_t)rows[r] * Hin, rw[r], ye + (size_t)r * Hin, (size_t)Hin);
    }
    int latent = c->routed_expert_hidden_size > 0;
    if (latent) {
        /* The latent norm is nonlinear: the routed sum must be complete before it (docs/model.md
         * §5.4), so it is all-reduced here; up-projection then runs replicated on every rank. */
        cpu_tp_sum(s, acc, (size_t)T * Hin);
        if (w->lat_norm) ds_rmsnorm(acc, acc, w->lat_norm, T, Hin, c->rms_norm_eps);
        ds_matmul(out, D, acc, Hin, T, &w->lat_up);
    } else {
        memcpy(out, acc, (size_t)T * D * sizeof(float));
    }
    if (c->num_shared_experts > 0) {
        float *sh = u; /* [T][D] reuse when Hin >= D; else take fresh */
        if (Hin < D) sh = sc_take(sc, (size_t)T * D);
        if (sc->overflow) return;
        mlp(s, &w->sh_gate, &w->sh_up, &w->sh_down, xn, T, sh);
        if (latent) cpu_tp_sum(s, sh, (size_t)T * D); /* out is already complete on every rank */
        ds_add(out, sh, (size_t)T * D);
    }
    if (!latent) cpu_tp_sum(s, out, (size_t)T * D); /* routed + shared partials in one all-reduce */
    sc->used = mark;
}
