/* comm.h — the one communication interface of a tensor- x pipeline-parallel job
 * (docs/parallelism.md, "Process model").
 *
 * A job has T x P ranks laid out as rank = stage * T + tp_rank: the T ranks of a stage form its
 * TP group (they all-reduce partial sums), and the ranks with the same tp_rank form a PP group
 * (stage s hands its tensors to stage s+1 of the same tp_rank, so every TP rank of the next stage
 * receives the full stream without a broadcast). World rank 0 (stage 0, tp 0) is the head.
 *
 * Two implementations sit behind the table of operations: comm_local.c (one process, T = P = 1:
 * every operation is a no-op) and comm_mpi.c (Open MPI). An NCCL one can follow: every operation
 * is a blocking collective or point-to-point call on float buffers, with no MPI types leaking into
 * this header.
 *
 * Failure: every operation returns DS_OK or DS_ERR with a message naming this rank. A rank that
 * fails must end the whole job (ds_comm_finish with a non-zero status aborts it), since its peers
 * would otherwise block forever in the next collective; a rank that dies is noticed by mpirun,
 * which ends the others and names the dead rank. */
#ifndef DS_COMM_H
#define DS_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"

typedef struct ds_comm ds_comm;

typedef struct ds_comm_ops {
    const char *name; /* "local", "mpi" */
    /* buf[n] <- sum over the TP group of every rank's buf[n], the same result on every rank */
    int (*allreduce_sum)(ds_comm *c, float *buf, size_t n, ds_err *err);
    /* buf[n] to the rank of stage `stage` with this rank's tp_rank (pipeline neighbours) */
    int (*send)(ds_comm *c, int stage, const float *buf, size_t n, ds_err *err);
    int (*recv)(ds_comm *c, int stage, float *buf, size_t n, ds_err *err);
    /* buf[n] bytes from world rank `root` to every rank; n must agree on all ranks (the head
     * broadcasts step plans, the sampling rank of the last stage broadcasts sampled tokens) */
    int (*bcast)(ds_comm *c, int root, void *buf, size_t n, ds_err *err);
    int (*barrier)(ds_comm *c, ds_err *err);
    /* Byte messages between any two ranks, for traffic that must not make ranks wait on each
     * other the way a collective does (pipelined steps): post copies buf[n] and returns at once
     * (the copy is sent in the background, in order per destination and tag); take waits for the
     * next message from `src` with `tag` and returns it malloc'd in *buf (*n bytes). */
    int (*post)(ds_comm *c, int dst, int tag, const void *buf, size_t n, ds_err *err);
    int (*take)(ds_comm *c, int src, int tag, void **buf, size_t *n, ds_err *err);
    /* status 0: orderly shutdown (collective); else end every rank of the job now */
    int (*finish)(ds_comm *c, int status);
    /* all[tp_size][n] <- every TP rank's mine[n], in tp_rank order, on every rank of the group
     * (vocabulary-parallel logits) */
    int (*allgather)(ds_comm *c, const float *mine, size_t n, float *all, ds_err *err);
} ds_comm_ops;

struct ds_comm {
    const ds_comm_ops *ops;
    int rank, size;       /* world */
    int local_rank;       /* among the job's ranks on this host (0 for one process) */
    int tp_rank, tp_size; /* within this stage's TP group */
    int stage, n_stages;  /* pipeline stage of this rank, P */
    char who[64];         /* "rank 3 (stage 1, tp 1)": prefixed to messages */
    ds_err last_err;      /* the failure ds_comm_allreduce_cb saw, for its caller to report */
    /* traffic this rank sent: pipeline hand-overs (send) and messages (post), in bytes; with
     * DS_COMM_STATS=1 each rank prints them when it finishes */
    uint64_t bytes_sent_pp, bytes_posted;
    /* seconds this rank spent waiting: on its sends, receives and collectives (wait_s), and for
     * messages (take_wait_s); printed with DS_COMM_STATS=1 to show where a pipeline stalls */
    double wait_s, take_wait_s;
    void *impl;
};

/* Single process: size 1, every operation a no-op. Cannot fail. */
ds_comm *ds_comm_local(void);

/* Started by mpirun (ds_comm_under_mpirun): initialises MPI and splits the world into TP and PP
 * groups. The world size must be tp * pp. Fails with a message when MPI support is missing. */
int ds_comm_mpi_init(int tp, int pp, ds_comm **out, ds_err *err);

/* True when this process was started by Open MPI's mpirun (OMPI_COMM_WORLD_SIZE is set). */
int ds_comm_under_mpirun(void);

/* The job-level entry: a local comm when tp * pp == 1 and not under mpirun, else MPI. */
int ds_comm_init(int tp, int pp, ds_comm **out, ds_err *err);

/* Ends this rank's part in the job and frees c. status 0: orderly (every rank must call it);
 * otherwise aborts the whole job so that no peer waits forever. Returns status. */
int ds_comm_finish(ds_comm *c, int status);

/* Convenience wrappers that read as verbs. */
static inline int ds_comm_allreduce_sum(ds_comm *c, float *buf, size_t n, ds_err *err) {
    return c->ops->allreduce_sum(c, buf, n, err);
}
static inline int ds_comm_allgather(ds_comm *c, const float *mine, size_t n, float *all,
                                    ds_err *err) {
    return c->ops->allgather(c, mine, n, all, err);
}
static inline int ds_comm_send(ds_comm *c, int stage, const float *buf, size_t n, ds_err *err) {
    return c->ops->send(c, stage, buf, n, err);
}
static inline int ds_comm_recv(ds_comm *c, int stage, float *buf, size_t n, ds_err *err) {
    return c->ops->recv(c, stage, buf, n, err);
}
static inline int ds_comm_bcast(ds_comm *c, void *buf, size_t n, ds_err *err) {
    return c->ops->bcast(c, 0, buf, n, err);
}
static inline int ds_comm_bcast_from(ds_comm *c, int root, void *buf, size_t n, ds_err *err) {
    return c->ops->bcast(c, root, buf, n, err);
}
static inline int ds_comm_post(ds_comm *c, int dst, int tag, const void *buf, size_t n,
                               ds_err *err) {
    return c->ops->post(c, dst, tag, buf, n, err);
}
static inline int ds_comm_take(ds_comm *c, int src, int tag, void **buf, size_t *n, ds_err *err) {
    return c->ops->take(c, src, tag, buf, n, err);
}
static inline int ds_comm_barrier(ds_comm *c, ds_err *err) {
    return c->ops->barrier(c, err);
}
/* A blob whose length only the head knows: the length goes first, then the bytes. On the other
 * ranks *buf is malloc'd (free it); on the head it is left as given. */
int ds_comm_bcast_blob(ds_comm *c, void **buf, size_t *n, ds_err *err);
/* The smallest of every rank's v, on every rank (a start-up agreement, e.g. on pool sizes; it costs
 * one broadcast per rank). */
int ds_comm_min_u64(ds_comm *c, uint64_t *v, ds_err *err);

/* Adapter for ds_model_opts.allreduce: ctx is the ds_comm. Errors are kept in the comm's last
 * error (ds_comm_last_error) because the model's callback has no ds_err of its own. */
int ds_comm_allreduce_cb(void *ctx, float *buf, size_t n);
const char *ds_comm_last_error(const ds_comm *c);
/* Adapter for ds_model_opts.allgather, likewise. */
int ds_comm_allgather_cb(void *ctx, const float *mine, size_t n, float *all);

/* This rank's index among the job's ranks on its host (0 in a single process): which of the
 * host's devices it takes. The transport knows it from its launcher (Open MPI's
 * OMPI_COMM_WORLD_LOCAL_RANK, else MPI_COMM_TYPE_SHARED), so no caller reads MPI's environment. */
int ds_comm_local_rank(const ds_comm *c);

/* Fills c->who from the rank fields. */
void ds_comm_set_who(ds_comm *c);

#endif
