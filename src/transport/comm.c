/* comm.c — the parts of the communication interface that do not depend on the transport: picking
 * one, the length-prefixed broadcast, and the adapter the model's all-reduce hook calls. */
#include "transport/comm.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int ds_comm_under_mpirun(void) {
    const char *s = getenv("OMPI_COMM_WORLD_SIZE");
    return s && *s;
}

int ds_comm_init(int tp, int pp, ds_comm **out, ds_err *err) {
    *out = NULL;
    if (tp < 1 || pp < 1)
        return ds_errf(err, "-tp and -pp must be at least 1 (got -tp %d -pp %d)", tp, pp);
    if (tp * pp == 1 && !ds_comm_under_mpirun()) {
        *out = ds_comm_local();
        return DS_OK;
    }
    return ds_comm_mpi_init(tp, pp, out, err);
}

int ds_comm_finish(ds_comm *c, int status) {
    if (!c) return status;
    const char *st = getenv("DS_COMM_STATS");
    if (st && *st && *st != '0' && c->size > 1)
        fprintf(stderr,
                "[deltaserve] %s sent %llu bytes to other stages, %llu in messages; waited %.2f s "
                "on transfers and collectives, %.2f s for messages\n",
                c->who, (unsigned long long)c->bytes_sent_pp, (unsigned long long)c->bytes_posted,
                c->wait_s, c->take_wait_s);
    fflush(stdout);
    fflush(stderr);
    return c->ops->finish(c, status);
}

int ds_comm_local_rank(const ds_comm *c) {
    return c ? c->local_rank : 0;
}

void ds_comm_set_who(ds_comm *c) {
    snprintf(c->who, sizeof c->who, "rank %d (stage %d, tp %d)", c->rank, c->stage, c->tp_rank);
}

int ds_comm_bcast_blob(ds_comm *c, void **buf, size_t *n, ds_err *err) {
    uint64_t len = c->rank == 0 ? (uint64_t)*n : 0;
    if (ds_comm_bcast(c, &len, sizeof len, err)) return DS_ERR;
    if (c->rank != 0) {
        *buf = ds_malloc(len ? (size_t)len : 1, err);
        if (!*buf) return DS_ERR;
        *n = (size_t)len;
    }
    return len ? ds_comm_bcast(c, *buf, (size_t)len, err) : DS_OK;
}

int ds_comm_min_u64(ds_comm *c, uint64_t *v, ds_err *err) {
    uint64_t m = *v;
    for (int r = 0; r < c->size; r++) {
        uint64_t x = *v;
        if (ds_comm_bcast_from(c, r, &x, sizeof x, err)) return DS_ERR;
        if (x < m) m = x;
    }
    *v = m;
    return DS_OK;
}

int ds_comm_allreduce_cb(void *ctx, float *buf, size_t n) {
    ds_comm *c = ctx;
    return ds_comm_allreduce_sum(c, buf, n, &c->last_err);
}

int ds_comm_allgather_cb(void *ctx, const float *mine, size_t n, float *all) {
    ds_comm *c = ctx;
    return ds_comm_allgather(c, mine, n, all, &c->last_err);
}

const char *ds_comm_last_error(const ds_comm *c) {
    return c->last_err.msg;
}
