/* pipeline.c — stage partition and the stage-to-stage hand-over (see pipeline.h). */
#include "parallel/pipeline.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int ds_pp_check_split(const char *model_dir, int tp, int pp, const char *partition, int *counts,
                      ds_err *err) {
    char path[4096];
    ds_config c;
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    if (tp < 1 || pp < 1)
        return ds_errf(err, "-tp and -pp must be at least 1 (got -tp %d -pp %d)", tp, pp);
    if (pp > DS_MAX_LAYERS) return ds_errf(err, "-pp %d: more stages than layers", pp);
    if (ds_config_load(path, &c, err) || ds_model_tp_check(&c, tp, err) ||
        ds_pp_partition(c.num_hidden_layers, pp, partition, counts, err))
        return DS_ERR;
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

int ds_pp_bufs_reserve(ds_pp_bufs *b, const ds_model *m, int T, ds_err *err) {
    if (T <= b->cap_tokens) return DS_OK;
    size_t TD = (size_t)T * ds_model_config(m)->hidden_size;
    int nb = ds_model_max_banks(m);
    for (int k = 0; k < 2; k++) {
        float *h = realloc(b->io[k].h, TD * sizeof(float));
        if (h) b->io[k].h = h;
        float *bk = realloc(b->io[k].banks, (size_t)(nb ? nb : 1) * TD * sizeof(float));
        if (bk) b->io[k].banks = bk;
        if (!h || !bk) return ds_errf(err, "out of memory for %d tokens of stage buffers", T);
    }
    b->cap_tokens = T;
    return DS_OK;
}

void ds_pp_bufs_free(ds_pp_bufs *b) {
    for (int k = 0; k < 2; k++) {
        free(b->io[k].h);
        free(b->io[k].banks);
    }
    memset(b, 0, sizeof *b);
}

int ds_pp_step(ds_comm *c, ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq,
               ds_pp_bufs *b, ds_err *err) {
    if (c->n_stages == 1) {
        if (ds_model_forward(m, pool, seqs, n_seq, err)) {
            if (c->last_err.msg[0]) ds_err_prefix(err, "%s", c->last_err.msg);
            return DS_ERR;
        }
        return DS_OK;
    }
    int T = 0, D = ds_model_config(m)->hidden_size, N = ds_model_config(m)->attn_res_block_size;
    for (int i = 0; i < n_seq; i++) T += seqs[i].n;
    if (ds_pp_bufs_reserve(b, m, T, err)) return DS_ERR;
    int first = c->stage == 0, last = c->stage == c->n_stages - 1;
    ds_stage_io *in = first ? NULL : &b->io[0], *out = last ? NULL : &b->io[1];
    if (in && ds_pp_recv(c, in, T, D, ds_pp_banks_before(N, ds_model_first_layer(m)), err))
        return DS_ERR;
    if (ds_model_forward_stage(m, pool, seqs, n_seq, in, out, err)) {
        if (c->last_err.msg[0]) ds_err_prefix(err, "%s", c->last_err.msg);
        return DS_ERR;
    }
    if (!out) return DS_OK;
    /* The receiver sizes its receive by its first layer (docs/model.md §6.4); a disagreement would
     * truncate the message or hang, so it is caught here. */
    int expect = ds_pp_banks_before(N, ds_model_end_layer(m));
    if (out->n_banks != expect)
        return ds_errf(err,
                       "%s: %d AttnRes blocks to hand on at layer %d, the next stage expects %d",
                       c->who, out->n_banks, ds_model_end_layer(m), expect);
    return ds_pp_send(c, out, T, D, err);
}

void ds_pp_rank_opts(ds_comm *c, const int *counts, ds_model_opts *o) {
    if (counts && c->n_stages > 1)
        ds_pp_stage_range(counts, c->stage, &o->layer_begin, &o->layer_end);
    o->tp_rank = c->tp_rank;
    o->tp_size = c->tp_size;
    o->allreduce = ds_comm_allreduce_cb;
    o->allreduce_ctx = c;
    o->allgather = ds_comm_allgather_cb;
    o->allgather_ctx = c;
}
