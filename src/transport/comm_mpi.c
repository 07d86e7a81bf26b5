/* comm_mpi.c — the communication interface over Open MPI.
 *
 * The world is split twice: by stage into TP groups (key tp_rank, so a TP group's rank is the
 * tp_rank) and by tp_rank into PP groups (key stage, so a PP group's rank is the stage number).
 * Every communicator returns MPI errors instead of aborting inside the library, so a failure
 * reaches the caller as a message naming this rank and the operation.
 *
 * Hangs: a peer that dies is noticed by mpirun, which kills the job and names the rank. A peer
 * that is alive but stuck is not; with DS_COMM_TIMEOUT_S=N (seconds, > 0) every operation gives
 * up with an error naming the peer after N seconds, so the caller can abort the job. Every
 * operation is posted non-blocking and polled with growing naps rather than MPI's spinning wait:
 * ranks are often oversubscribed, and an idle serving rank must not burn a core. */
#include "transport/comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A byte message on its way (ds_comm_post): its own copy, freed once MPI is done with it. */
typedef struct posted {
    MPI_Request req;
    void *copy;
} posted;

typedef struct mpi_impl {
    MPI_Comm tp, pp;  /* this stage's TP group; this tp_rank's pipeline */
    MPI_Comm msg;     /* byte messages (post / take), apart from every collective */
    double timeout_s; /* 0: block forever */
    posted *posts;    /* [n_posts] not yet known to be delivered */
    int n_posts, cap_posts;
} mpi_impl;

static mpi_impl *impl_of(ds_comm *c) {
    return c->impl;
}

static int mpi_fail(ds_comm *c, int rc, const char *what, ds_err *err) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    return ds_errf(err, "%s: %s: %s", c->who, what, s);
}

/* Waits for req, polling when a timeout is set. Yields the core between polls: ranks are often
 * oversubscribed (8 ranks on 2 cores in the tests), and a spinning waiter starves the peer it
 * waits for. */
static int wait_req_at(ds_comm *c, MPI_Request *req, const char *what, double t0, double limit,
                       ds_err *err) {
    long nap_ns = 20000; /* grows to 1 ms: an idle serving rank waits for the next plan this way */
    for (long spins = 0;; spins++) {
        int done = 0;
        int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what, err);
        if (done) return DS_OK;
        if (limit > 0 && MPI_Wtime() - t0 > limit) {
            MPI_Cancel(req);
            return ds_errf(err, "%s: %s: no answer after %.0f s (DS_COMM_TIMEOUT_S)", c->who, what,
                           limit);
        }
        if (spins > 200) {
            nanosleep(&(struct timespec){0, nap_ns}, NULL);
            if (nap_ns < 1000000) nap_ns += nap_ns / 4;
        }
    }
}

static int wait_req(ds_comm *c, MPI_Request *req, const char *what, ds_err *err) {
    double limit = impl_of(c)->timeout_s;
    double t0 = MPI_Wtime();
    int rc = wait_req_at(c, req, what, t0, limit, err);
    c->wait_s += MPI_Wtime() - t0;
    return rc;
}

/* Messages are cut into pieces MPI's int counts can hold. */
enum { PIECE = 1 << 30 };

static int mpi_allreduce(ds_comm *c, float *buf, size_t n, ds_err *err) {
    if (c->tp_size == 1) return DS_OK;
    char what[96];
    snprintf(what, sizeof what, "all-reduce of %zu floats in the TP group of stage %d", n,
             c->stage);
    for (size_t off = 0; off < n; off += PIECE) {
        int cnt = (int)DS_MIN((size_t)PIECE, n - off);
        MPI_Request req;
        int rc =
            MPI_Iallreduce(MPI_IN_PLACE, buf + off, cnt, MPI_FLOAT, MPI_SUM, impl_of(c)->tp, &req);
        if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what, err);
        if (wait_req(c, &req, what, err)) return DS_ERR;
    }
    return DS_OK;
}

static int mpi_allgather(ds_comm *c, const float *mine, size_t n, float *all, ds_err *err) {
    if (c->tp_size == 1) {
        if (all != mine) memmove(all, mine, n * sizeof *all);
        return DS_OK;
    }
    char what[96];
    snprintf(what, sizeof what, "all-gather of %zu floats per rank in the TP group of stage %d", n,
             c->stage);
    /* one call: the pieces of a cut message would interleave wrongly in `all` */
    if (n > (size_t)INT_MAX) return ds_errf(err, "%s: %s: too large", c->who, what);
    MPI_Request req;
    int rc = MPI_Iallgather(mine, (int)n, MPI_FLOAT, all, (int)n, MPI_FLOAT, impl_of(c)->tp, &req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what, err);
    return wait_req(c, &req, what, err);
}

static int check_stage(ds_comm *c, int stage, const char *verb, ds_err *err) {
    if (stage < 0 || stage >= c->n_stages || stage == c->stage)
        return ds_errf(err, "%s: %s stage %d: not another stage of this %d-stage job", c->who, verb,
                       stage, c->n_stages);
    return DS_OK;
}

static int mpi_send(ds_comm *c, int stage, const float *buf, size_t n, ds_err *err) {
    if (check_stage(c, stage, "send to", err)) return DS_ERR;
    char what[96];
    snprintf(what, sizeof what, "send of %zu floats to stage %d (rank %d)", n, stage,
             stage * c->tp_size + c->tp_rank);
    for (size_t off = 0; off < n; off += PIECE) {
        int cnt = (int)DS_MIN((size_t)PIECE, n - off);
        MPI_Request req;
        int rc = MPI_Isend(buf + off, cnt, MPI_FLOAT, stage, 0, impl_of(c)->pp, &req);
        if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what, err);
        if (wait_req(c, &req, what, err)) return DS_ERR;
        c->bytes_sent_pp += (uint64_t)cnt * sizeof(float);
    }
    return DS_OK;
}

static int mpi_recv(ds_comm *c, int stage, float *buf, size_t n, ds_err *err) {
    if (check_stage(c, stage, "receive from", err)) return DS_ERR;
    char what[96];
    snprintf(what, sizeof what, "receive of %zu floats from stage %d (rank %d)", n, stage,
             stage * c->tp_size + c->tp_rank);
    for (size_t off = 0; off < n; off += PIECE) {
        int cnt = (int)DS_MIN((size_t)PIECE, n - off);
        MPI_Request req;
        int rc = MPI_Irecv(buf + off, cnt, MPI_FLOAT, stage, 0, impl_of(c)->pp, &req);
        if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what, err);
        if (wait_req(c, &req, what, err)) return DS_ERR;
    }
    return DS_OK;
}

static int mpi_bcast(ds_comm *c, int root, void *buf, size_t n, ds_err *err) {
    if (c->size == 1) return DS_OK;
    char what[96];
    if (root < 0 || root >= c->size)
        return ds_errf(err, "%s: broadcast from rank %d of %d", c->who, root, c->size);
    snprintf(what, sizeof what, "broadcast of %zu bytes from rank %d", n, root);
    for (size_t off = 0; off < n; off += PIECE) {
        int cnt = (int)DS_MIN((size_t)PIECE, n - off);
        MPI_Request req;
        int rc = MPI_Ibcast((char *)buf + off, cnt, MPI_BYTE, root, MPI_COMM_WORLD, &req);
        if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what, err);
        if (wait_req(c, &req, what, err)) return DS_ERR;
    }
    return DS_OK;
}

/* Frees the copies of posts MPI has finished with (all of them when `all`, waiting). */
static int reap_posts(ds_comm *c, int all, ds_err *err) {
    mpi_impl *im = impl_of(c);
    int k = 0;
    for (int i = 0; i < im->n_posts; i++) {
        int done = 0;
        if (all) {
            if (wait_req(c, &im->posts[i].req, "delivering a message", err)) return DS_ERR;
            done = 1;
        } else if (MPI_Test(&im->posts[i].req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
            return ds_errf(err, "%s: a posted message failed", c->who);
        }
        if (done)
            free(im->posts[i].copy);
        else
            im->posts[k++] = im->posts[i];
    }
    im->n_posts = k;
    return DS_OK;
}

static int mpi_post(ds_comm *c, int dst, int tag, const void *buf, size_t n, ds_err *err) {
    mpi_impl *im = impl_of(c);
    if (dst < 0 || dst >= c->size || dst == c->rank)
        return ds_errf(err, "%s: message to rank %d of %d", c->who, dst, c->size);
    if (n > INT_MAX) return ds_errf(err, "%s: message of %zu bytes is too large", c->who, n);
    if (reap_posts(c, 0, err)) return DS_ERR;
    if (im->n_posts == im->cap_posts) {
        int cap = im->cap_posts ? 2 * im->cap_posts : 16;
        posted *p = realloc(im->posts, (size_t)cap * sizeof *p);
        if (!p) return ds_errf(err, "%s: out of memory for messages", c->who);
        im->posts = p;
        im->cap_posts = cap;
    }
    posted *p = &im->posts[im->n_posts];
    p->copy = ds_malloc(n ? n : 1, err);
    if (!p->copy) return DS_ERR;
    if (n) memcpy(p->copy, buf, n); /* an empty message may come with no buffer */
    int rc = MPI_Isend(p->copy, (int)n, MPI_BYTE, dst, tag, im->msg, &p->req);
    if (rc != MPI_SUCCESS) {
        free(p->copy);
        return mpi_fail(c, rc, "posting a message", err);
    }
    im->n_posts++;
    c->bytes_posted += n;
    return DS_OK;
}

static int mpi_take(ds_comm *c, int src, int tag, void **buf, size_t *n, ds_err *err) {
    mpi_impl *im = impl_of(c);
    char what[96];
    snprintf(what, sizeof what, "message (tag %d) from rank %d", tag, src);
    if (src < 0 || src >= c->size || src == c->rank)
        return ds_errf(err, "%s: message from rank %d of %d", c->who, src, c->size);
    /* Probe with the same polling as every other wait (timeout, naps), then receive. */
    double t0 = MPI_Wtime();
    long nap_ns = 20000;
    MPI_Message m;
    MPI_Status st;
    for (long spins = 0;; spins++) {
        int found = 0;
        int rc = MPI_Improbe(src, tag, im->msg, &found, &m, &st);
        if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what, err);
        if (found) break;
        if (reap_posts(c, 0, err)) return DS_ERR;
        if (im->timeout_s > 0 && MPI_Wtime() - t0 > im->timeout_s)
            return ds_errf(err, "%s: %s: no answer after %.0f s (DS_COMM_TIMEOUT_S)", c->who, what,
                           im->timeout_s);
        if (spins > 200) {
            nanosleep(&(struct timespec){0, nap_ns}, NULL);
            if (nap_ns < 1000000) nap_ns += nap_ns / 4;
        }
    }
    c->take_wait_s += MPI_Wtime() - t0;
    int cnt = 0;
    MPI_Get_count(&st, MPI_BYTE, &cnt);
    *buf = ds_malloc(cnt ? (size_t)cnt : 1, err);
    if (!*buf) return DS_ERR;
    int rc = MPI_Mrecv(*buf, cnt, MPI_BYTE, &m, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
        free(*buf);
        *buf = NULL;
        return mpi_fail(c, rc, what, err);
    }
    *n = (size_t)cnt;
    return DS_OK;
}

static int mpi_barrier(ds_comm *c, ds_err *err) {
    MPI_Request req;
    int rc = MPI_Ibarrier(MPI_COMM_WORLD, &req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "barrier", err);
    return wait_req(c, &req, "barrier", err);
}

static int mpi_finish(ds_comm *c, int status) {
    mpi_impl *im = impl_of(c);
    if (status) {
        /* Peers may be blocked in a collective with this rank: only an abort frees them. mpirun
         * prints which rank aborted and ends the job with a non-zero status. */
        MPI_Abort(MPI_COMM_WORLD, status);
        return status; /* not reached */
    }
    if (im) {
        ds_err e2;
        reap_posts(c, 1, &e2); /* every message reaches its rank before MPI goes */
        free(im->posts);
        if (im->tp != MPI_COMM_NULL) MPI_Comm_free(&im->tp);
        if (im->pp != MPI_COMM_NULL) MPI_Comm_free(&im->pp);
        if (im->msg != MPI_COMM_NULL) MPI_Comm_free(&im->msg);
    }
    free(im);
    free(c);
    MPI_Finalize();
    return status;
}

static const ds_comm_ops MPI_OPS = {"mpi",      mpi_allreduce, mpi_send, mpi_recv,
                                    mpi_bcast,  mpi_barrier,   mpi_post, mpi_take,
                                    mpi_finish, mpi_allgather};

/* c->local_rank: Open MPI's mpirun says it (OMPI_COMM_WORLD_LOCAL_RANK, set on every rank or on
 * none); another launcher's ranks find it among the ranks that share their host's memory. */
static int mpi_local_rank(ds_comm *c, ds_err *err) {
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (local && *local) {
        c->local_rank = atoi(local);
        return DS_OK;
    }
    MPI_Comm node;
    int rc =
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(node, &c->local_rank);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "finding the ranks of this host", err);
    MPI_Comm_free(&node);
    return DS_OK;
}

int ds_comm_mpi_init(int tp, int pp, ds_comm **out, ds_err *err) {
    *out = NULL;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        /* SERIALIZED: one thread at a time makes MPI calls (a serving rank's engine thread while
         * it runs, main before and after); OpenMP threads never do. */
        int provided;
        if (MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
            return ds_errf(err, "MPI_Init_thread failed");
        if (provided < MPI_THREAD_SERIALIZED) {
            MPI_Abort(MPI_COMM_WORLD, 1);
            return ds_errf(err, "this MPI library cannot be called from a second thread");
        }
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    ds_comm *c = ds_calloc(1, sizeof *c, err);
    mpi_impl *im = ds_calloc(1, sizeof *im, err);
    if (!c || !im) {
        free(c);
        free(im);
        MPI_Abort(MPI_COMM_WORLD, 1); /* peers are already inside MPI and would wait */
        return DS_ERR;
    }
    c->ops = &MPI_OPS;
    c->impl = im;
    im->tp = im->pp = im->msg = MPI_COMM_NULL;
    MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &c->size);
    c->tp_size = 1;
    c->n_stages = 1;
    ds_comm_set_who(c);
    *out = c; /* from here on the caller ends the job through ds_comm_finish, even after errors */
    const char *to = getenv("DS_COMM_TIMEOUT_S");
    im->timeout_s = to && *to ? atof(to) : 0;
    if (tp < 1 || pp < 1 || (long)tp * pp != c->size)
        return ds_errf(err,
                       "%s: -tp %d x -pp %d needs %ld ranks, but mpirun started %d (use mpirun "
                       "-np %ld, or start deltaserve without mpirun and it launches itself)",
                       c->who, tp, pp, (long)tp * pp, c->size, (long)tp * pp);
    c->tp_size = tp;
    c->n_stages = pp;
    c->tp_rank = c->rank % tp;
    c->stage = c->rank / tp;
    ds_comm_set_who(c);
    int rc = MPI_Comm_split(MPI_COMM_WORLD, c->stage, c->tp_rank, &im->tp);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_split(MPI_COMM_WORLD, c->tp_rank, c->stage, &im->pp);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_dup(MPI_COMM_WORLD, &im->msg);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "splitting TP and PP groups", err);
    if (mpi_local_rank(c, err)) return DS_ERR;
    MPI_Comm_set_errhandler(im->tp, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(im->pp, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(im->msg, MPI_ERRORS_RETURN);
    return DS_OK;
}
