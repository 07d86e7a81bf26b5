/* moe.c — the MoE router for one token (docs/model.md §5.3).
 *
 *   s  = sigmoid(z)                        scores, f32
 *   s' = s + bias                          selection scores (bias: e_score_correction_bias)
 *   group-limited selection (n_group > 1): group score = sum of the two largest s' in each group of
 *       E/n_group consecutive experts; the topk_group best groups stay, s' of the others := -inf
 *   idx = the k largest s'                 ties go to the lower index; idx is ordered by s'
 *   w   = s[idx]                           UNBIASED (DeepSeek-V3 / vLLM / ATOM / HF-K3)
 *   w  /= sum(w) + 1e-20                   when renormalize && k > 1
 *   w  *= scale                            routed_scaling_factor
 *
 * hf_kl_quirk reproduces Moonshot's Kimi-Linear remote code, where `scores_for_choice` is a view
 * of `scores` and the bias is added in place: the gathered weights are the biased s + b, and the
 * masked groups are filled with 0.0 instead of -inf (which lets a masked expert beat experts whose
 * biased score is negative). Only for parity tests against that code.
 *
 * The router is a few hundred scalar operations per token, so it has one portable version. */
#include "kernels/cpu/kernels.h"
#include "kernels/shared/moe_topk.h"

#include <math.h>
#include <stdlib.h>

/* Scratch up to these sizes lives on the stack (K3: 2*896 + 16 floats, a handful of groups). */
#define ROUTE_STACK_FLOATS 4096
#define ROUTE_STACK_GROUPS 256

void ds_moe_route(int32_t *idx, float *w, const float *z, const float *bias, int E, int k,
                  int n_group, int topk_group, int renormalize, float scale, int hf_kl_quirk) {
    if (k <= 0) return;
    const int grouped = n_group > 1 && topk_group > 0 && topk_group < n_group && E % n_group == 0;
    const int G = grouped ? n_group : 0;
    /* scratch: s [E] sigmoid scores | sel [E] selection scores | gval [G] | val [k];
     * gid: [G] the kept groups */
    const size_t need = 2 * (size_t)E + (size_t)G + (size_t)k;
    float stack_f[ROUTE_STACK_FLOATS];
    int32_t stack_g[ROUTE_STACK_GROUPS];
    float *scratch = need <= ROUTE_STACK_FLOATS ? stack_f : malloc(need * sizeof(float));
    int32_t *gid = G <= ROUTE_STACK_GROUPS ? stack_g : malloc((size_t)G * sizeof(int32_t));
    if (!scratch || !gid) { /* cannot route: send the token nowhere rather than crash */
        for (int j = 0; j < k; j++) {
            idx[j] = 0;
            w[j] = 0.0f;
        }
        if (scratch != stack_f) free(scratch);
        if (gid != stack_g) free(gid);
        return;
    }
    float *s = scratch, *sel = s + E, *gval = sel + E, *val = gval + G;

    for (int e = 0; e < E; e++) {
        s[e] = 1.0f / (1.0f + expf(-z[e]));
        sel[e] = bias ? s[e] + bias[e] : s[e];
        if (isnan(sel[e])) sel[e] = -INFINITY; /* a NaN logit is never preferred to a real one */
    }

    if (grouped) ds_moe_mask_groups(sel, E, G, topk_group, hf_kl_quirk, gval, gid);
    int count = 0;
    for (int e = 0; e < E; e++) count = ds_top_insert(val, idx, count, k, sel[e], e);
    ds_moe_weights(idx, w, s, bias, count, k, renormalize, scale, hf_kl_quirk);
    if (scratch != stack_f) free(scratch);
    if (gid != stack_g) free(gid);
}
