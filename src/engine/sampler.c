#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>

void ds_sampling_default(ds_sampling *s) {
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->top_k = 0;
    s->min_p = 0.0f;
}

static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Orders ids by descending probability, ties by ascending id, so the order is deterministic. */
static int cmp_desc(const void *a, const void *b, void *vals) {
    const float *v = vals;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (v[i] > v[j]) return -1;
    if (v[i] < v[j]) return 1;
    return (i > j) - (i < j);
}

int32_t ds_sample(float *logits, int V, const ds_sampling *p, ds_rng *rng, float *probs,
                  int32_t *idx) {
    if (p->temperature <= 0.0f) return argmax(logits, V);
    float mx = logits[argmax(logits, V)];
    double sum = 0;
    for (int i = 0; i < V; i++) {
        probs[i] = expf((logits[i] - mx) / p->temperature);
        sum += probs[i];
    }
    for (int i = 0; i < V; i++) {
        probs[i] = (float)(probs[i] / sum);
        idx[i] = i;
    }
    int n = V;
    qsort_r(idx, (size_t)V, sizeof *idx, cmp_desc, probs);
    if (p->top_k > 0 && p->top_k < n) n = p->top_k;
    if (p->min_p > 0.0f) { /* drop tokens below min_p times the most likely one */
        float floor_p = p->min_p * probs[idx[0]];
        int keep = 1;
        while (keep < n && probs[idx[keep]] >= floor_p) keep++;
        n = keep;
    }
    if (p->top_p < 1.0f) {
        double cum = 0;
        int keep = 0;
        while (keep < n) {
            cum += probs[idx[keep]];
            keep++;
            if (cum >= p->top_p) break;
        }
        n = keep;
    }
    double total = 0;
    for (int i = 0; i < n; i++) total += probs[idx[i]];
    double u = ds_rng_uniform(rng) * total, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += probs[idx[i]];
        if (u < acc) return idx[i];
    }
    return idx[n - 1];
}
