/* draw_host.c — a step's sampled rows drawn on the host (see draw_host.h). */
#include "backend/draw_host.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

int ds_host_draws_space(ds_host_draws *h, int V, ds_err *err) {
    if (h->sc) return DS_OK;
    int n = omp_get_max_threads();
    h->rows = ds_malloc((size_t)DS_DRAW_CHUNK * V * sizeof(float), err);
    ds_sample_scratch **sc = h->rows ? ds_calloc((size_t)n, sizeof *sc, err) : NULL;
    for (int i = 0; sc && i < n; i++)
        if (!(sc[i] = ds_sample_scratch_new(V, err))) {
            for (int j = 0; j < i; j++) ds_sample_scratch_free(sc[j]);
            free(sc);
            sc = NULL;
        }
    if (!sc) {
        free(h->rows);
        h->rows = NULL;
        return DS_ERR;
    }
    h->sc = sc;
    h->n_sc = n;
    return DS_OK;
}

void ds_host_draws_free(ds_host_draws *h) {
    free(h->rows);
    for (int i = 0; i < h->n_sc; i++) ds_sample_scratch_free(h->sc[i]);
    free(h->sc);
    memset(h, 0, sizeof *h);
}

void ds_host_draws_run(ds_host_draws *h, int V, const float *x, size_t stride, int vp, int n,
                       const ds_row_draw *const *d, int32_t *const *out) {
    for (int j0 = 0; j0 < n; j0 += DS_DRAW_CHUNK) {
        int nc = DS_MIN(DS_DRAW_CHUNK, n - j0), nd = 0;
        for (int j = j0; j < j0 + nc; j++) {
            if (!d[j]) continue;
            nd++;
            float *row = h->rows + (size_t)(j - j0) * V; /* the row whole, to be edited */
            for (int v0 = 0, t = 0; v0 < V; v0 += vp, t++)
                memcpy(row + v0, x + (size_t)t * stride + (size_t)j * vp,
                       (size_t)DS_MIN(vp, V - v0) * sizeof(float));
        }
#pragma omp parallel for schedule(dynamic) num_threads(h->n_sc) if (nd > 1)
        for (int j = j0; j < j0 + nc; j++)
            if (d[j])
                *out[j] = ds_sample_row(h->rows + (size_t)(j - j0) * V, V, d[j],
                                        h->sc[omp_get_thread_num()]);
    }
}
