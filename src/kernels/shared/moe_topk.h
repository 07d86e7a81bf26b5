/* moe_topk.h — the MoE router's selection, one definition for the CPU router (kernels/cpu/moe.c)
 * and the GPU's (kernels/cuda/moe_router.cu), so that both pick the same experts with the same
 * weights: the ordered top-n insertion (ties to the lower index, which also takes the top k), the
 * group-limited mask, and the weights gathered from the unbiased scores. Every function takes the
 * same float operations in the same order on both sides. */
#ifndef DS_MOE_TOPK_H
#define DS_MOE_TOPK_H

#include "kernels/shared/hd.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Keeps the n best (value, index) pairs seen so far in val/id[0..count), best first. Candidates
 * arrive in increasing index order and an equal value never displaces an earlier one, so ties go
 * to the lower index. Returns the new count. */
static inline DS_HD int ds_top_insert(float *val, int32_t *id, int count, int n, float v,
                                      int32_t i) {
    if (count == n && !(v > val[n - 1])) return count;
    int pos = count < n ? count : n - 1;
    while (pos > 0 && v > val[pos - 1]) {
        val[pos] = val[pos - 1];
        id[pos] = id[pos - 1];
        pos--;
    }
    val[pos] = v;
    id[pos] = i;
    return count < n ? count + 1 : count;
}

/* Group-limited selection over sel [E] (G groups of E / G consecutive experts): a group's score
 * is the sum of its two largest sel (the largest alone in groups of one), the topk_group best
 * groups stay, and the sel of every other group's experts becomes -inf (0 with hf_kl_quirk:
 * Moonshot's masked_fill, see moe.c). gval [topk_group], gid [topk_group]: scratch. */
static inline DS_HD void ds_moe_mask_groups(float *sel, int E, int G, int topk_group,
                                            int hf_kl_quirk, float *gval, int32_t *gid) {
    const int gsize = E / G;
    int ng = 0;
    for (int g = 0; g < G; g++) {
        const float *gs = sel + (size_t)g * (size_t)gsize;
        float t1 = -INFINITY, t2 = -INFINITY; /* the two largest selection scores */
        for (int e = 0; e < gsize; e++) {
            if (gs[e] > t1) {
                t2 = t1;
                t1 = gs[e];
            } else if (gs[e] > t2) {
                t2 = gs[e];
            }
        }
        ng = ds_top_insert(gval, gid, ng, topk_group, gsize >= 2 ? t1 + t2 : t1, g);
    }
    for (int g = 0; g < G; g++) {
        int kept = 0;
        for (int j = 0; j < ng; j++) kept |= gid[j] == g;
        if (kept) continue;
        for (int e = 0; e < gsize; e++)
            sel[(size_t)g * (size_t)gsize + (size_t)e] = hf_kl_quirk ? 0.0f : -INFINITY;
    }
}

/* w [k] from the sigmoid scores s [E] of the count chosen idx [k] (the slots past count: expert 0,
 * weightless), renormalised when asked (k > 1), times scale. The quirk gathers from the biased
 * (but unmasked) scores: its masked_fill was out of place. */
static inline DS_HD void ds_moe_weights(int32_t *idx, float *w, const float *s, const float *bias,
                                        int count, int k, int renormalize, float scale,
                                        int hf_kl_quirk) {
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        if (j >= count) { /* k > E: pad with weightless copies of expert 0 */
            idx[j] = 0;
            w[j] = 0.0f;
            continue;
        }
        const int e = idx[j];
        w[j] = hf_kl_quirk && bias ? s[e] + bias[e] : s[e];
        sum += w[j];
    }
    if (renormalize && k > 1) {
        const float den = sum + 1e-20f;
        for (int j = 0; j < k; j++) w[j] = w[j] / den * scale;
    } else {
        for (int j = 0; j < k; j++) w[j] *= scale;
    }
}

#endif
