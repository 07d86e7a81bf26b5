/* pipeline.c — stage partition and the stage-to-stage hand-over (see pipeline.h). */
#include "dist/pipeline.h"

#include <errno.h>
#include <stdlib.h>

int ds_pp_partition(int L, int P, const char *spec, int *counts, ds_err *err) {
    if (P < 1 || L < 1)
        return ds_errf(err, "pipeline: need >= 1 stage and layer (got %d, %d)", P, L);
    if (!spec || !*spec) {
        if (P > L)
            return ds_errf(err, "pipeline: %d stages for %d layers; every stage needs a layer", P,
                           L);
        int base = L / P, r = L % P, start = (P - r) / 2;
        for (int s = 0; s < P; s++) counts[s] = base + (s >= start && s < start + r);
        return DS_OK;
    }
    int n = 0, sum = 0;
    const char *p = spec;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 1 || v > L || (*end && *end != ','))
            return ds_errf(err,
                           "--pp-layer-partition '%s': expected comma-separated layer counts >= 1, "
                           "bad entry at '%.20s'",
                           spec, p);
        if (n == P)
            return ds_errf(err, "--pp-layer-partition '%s': more than the %d stages of -pp %d",
                           spec, P, P);
        counts[n++] = (int)v;
        sum += (int)v;
        p = *end ? end + 1 : end;
    }
    if (n != P) return ds_errf(err, "--pp-layer-partition '%s': %d entries for -pp %d", spec, n, P);
    if (sum != L)
        return ds_errf(err, "--pp-layer-partition '%s': sums to %d layers, the model has %d", spec,
                       sum, L);
    return DS_OK;
}

void ds_pp_stage_range(const int *counts, int stage, int *begin, int *end) {
    int b = 0;
    for (int s = 0; s < stage; s++) b += counts[s];
    *begin = b;
    *end = b + counts[stage];
}

int ds_pp_banks_before(int attn_res_block_size, int layer) {
    int N = attn_res_block_size;
    return N > 0 && layer >= 1 ? (layer - 1) / N + 1 : 0;
}

int ds_pp_send(ds_comm *c, const ds_stage_io *io, int T, int D, ds_err *err) {
    size_t TD = (size_t)T * D;
    if (ds_comm_send(c, c->stage + 1, io->h, TD, err)) return DS_ERR;
    return io->n_banks ? ds_comm_send(c, c->stage + 1, io->banks, (size_t)io->n_banks * TD, err)
                       : DS_OK;
}

int ds_pp_recv(ds_comm *c, ds_stage_io *io, int T, int D, int n_banks, ds_err *err) {
    size_t TD = (size_t)T * D;
    if (ds_comm_recv(c, c->stage - 1, io->h, TD, err)) return DS_ERR;
    io->n_banks = n_banks;
    return n_banks ? ds_comm_recv(c, c->stage - 1, io->banks, (size_t)n_banks * TD, err) : DS_OK;
}
