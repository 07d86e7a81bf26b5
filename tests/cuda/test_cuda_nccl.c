/* test_cuda_nccl.c — the NCCL binding on one GPU (where the build has NCCL). */
#include "cuda_check.h"
#ifdef DS_HAVE_NCCL
#include "transport/comm_nccl.h"
#endif

#ifdef DS_HAVE_NCCL
/* The NCCL binding on one GPU: a group of one rank joins, and its sum of a buffer on the
 * backend's stream is the buffer, bit for bit (the sum between GPUs needs two of them:
 * tools/device/cuda_pp_check.sh on nvidia-h200-x2). */
static void check_nccl_one_rank(ds_cu *c) {
    unsigned char id[DS_NCCL_ID_BYTES];
    ds_nccl *n = NULL;
    ds_err err = {{0}};
    if (ds_nccl_unique_id(id, &err) || ds_nccl_init(&n, id, 1, 0, 0, &err)) DIE("%s", err.msg);
    const size_t len = 100003;
    float *x = rand_f32(len, -3, 3), *got = malloc(len * 4);
    float *d = dev(c, x, len * 4);
    if (ds_nccl_allreduce_sum(n, d, len, ds_cu_stream(c), &err) || ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    fetch(c, got, d, len * 4);
    report("nccl one rank: all-reduce is the identity", rel_err(got, x, 1, len, len), 0.0);
    ds_nccl_free(n);
    ds_cu_dealloc(d);
    free(x), free(got);
}
#endif

/* the one-rank all-reduce (nothing without NCCL) */
void checks_nccl(ds_cu *c) {
#ifdef DS_HAVE_NCCL
    check_nccl_one_rank(c);
#endif
}
