/* comm_nccl.h — tensor-parallel sums between GPUs through NCCL (issue 9), for the CUDA forward.
 *
 * The job's own communicator (comm.h, MPI) bootstraps it: tp rank 0 makes the unique id, every
 * rank of the TP group receives it through the group's all-gather, and each rank joins with its
 * own GPU (NCCL takes one GPU per rank: ranks sharing a GPU keep the host-staged sums). The sum
 * runs on the forward's stream, so a step that uses it can still be captured as a graph.
 * Built when `make cuda` finds NCCL beside the CUDA toolkit (DS_HAVE_NCCL). */
#ifndef DS_COMM_NCCL_H
#define DS_COMM_NCCL_H

#include <stddef.h>

#include "base/ds_base.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DS_NCCL_ID_BYTES = 128 };
typedef struct ds_nccl ds_nccl;

/* id [DS_NCCL_ID_BYTES] <- a new unique id (on tp rank 0 only). */
int ds_nccl_unique_id(void *id, ds_err *err);
/* Joins the group of n_ranks as `rank` on GPU `device` (collective over the group). */
int ds_nccl_init(ds_nccl **out, const void *id, int n_ranks, int rank, int device, ds_err *err);
/* buf[n] (device memory) <- the group's sum, queued on `stream` (a cudaStream_t). */
int ds_nccl_allreduce_sum(ds_nccl *c, float *buf, size_t n, void *stream, ds_err *err);
void ds_nccl_free(ds_nccl *c);

#ifdef __cplusplus
}
#endif

#endif
