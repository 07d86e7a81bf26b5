/* comm_local.c — the communication interface of a single process (T = P = 1): the sum over a
 * group of one is the buffer itself, and there is no neighbour to send to. */
#include "transport/comm.h"

#include <string.h>

static int local_allreduce(ds_comm *c, float *buf, size_t n, ds_err *err) {
    (void)c, (void)buf, (void)n, (void)err;
    return DS_OK;
}

static int local_allgather(ds_comm *c, const float *mine, size_t n, float *all, ds_err *err) {
    (void)c, (void)err;
    if (all != mine) memmove(all, mine, n * sizeof *all);
    return DS_OK;
}

/* A single process has no pipeline neighbour: a send or receive is a caller's bug. */
static int local_send(ds_comm *c, int stage, const float *buf, size_t n, ds_err *err) {
    (void)buf, (void)n;
    return ds_errf(err, "%s: send to stage %d in a single-process job", c->who, stage);
}
static int local_recv(ds_comm *c, int stage, float *buf, size_t n, ds_err *err) {
    (void)buf, (void)n;
    return ds_errf(err, "%s: receive from stage %d in a single-process job", c->who, stage);
}

static int local_bcast(ds_comm *c, int root, void *buf, size_t n, ds_err *err) {
    (void)c, (void)root, (void)buf, (void)n, (void)err;
    return DS_OK;
}

static int local_barrier(ds_comm *c, ds_err *err) {
    (void)c, (void)err;
    return DS_OK;
}

/* One process has no one to message. */
static int local_post(ds_comm *c, int dst, int tag, const void *buf, size_t n, ds_err *err) {
    (void)buf, (void)n, (void)tag;
    return ds_errf(err, "%s: message to rank %d in a single-process job", c->who, dst);
}
static int local_take(ds_comm *c, int src, int tag, void **buf, size_t *n, ds_err *err) {
    (void)buf, (void)n, (void)tag;
    return ds_errf(err, "%s: message from rank %d in a single-process job", c->who, src);
}

/* The local comm is a static object: nothing to free. */
static int local_finish(ds_comm *c, int status) {
    (void)c;
    return status;
}

static const ds_comm_ops LOCAL_OPS = {"local",      local_allreduce, local_send, local_recv,
                                      local_bcast,  local_barrier,   local_post, local_take,
                                      local_finish, local_allgather};

ds_comm *ds_comm_local(void) {
    /* One per process; its only mutable field is last_err, which a local all-reduce never sets. */
    static ds_comm c = {
        .ops = &LOCAL_OPS, .size = 1, .tp_size = 1, .n_stages = 1, .who = "rank 0 (stage 0, tp 0)"};
    return &c;
}
