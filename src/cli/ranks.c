/* ranks.c — see ranks.h. */
#include "cli/ranks.h"

#include "dist/pipeline.h"

#include <stdlib.h>
#include <string.h>

int ds_rank_open(const char *model_dir, int tp, int pp, const int *counts,
                 const ds_model_opts *base, ds_rank *r, ds_err *err) {
    memset(r, 0, sizeof *r);
    if (ds_comm_init(tp, pp, &r->comm, err)) return DS_ERR;
    ds_model_opts o = *base;
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK"); /* one GPU per rank of a host */
    if (local) o.device_index = atoi(local);
    ds_pp_stage_range(counts, r->comm->stage, &o.layer_begin, &o.layer_end);
    o.tp_rank = r->comm->tp_rank;
    o.tp_size = r->comm->tp_size;
    o.allreduce = ds_comm_allreduce_cb;
    o.allreduce_ctx = r->comm;
    o.allgather = ds_comm_allgather_cb;
    o.allgather_ctx = r->comm;
    r->first = r->comm->stage == 0;
    r->last = r->comm->stage == pp - 1;
    return ds_model_load(model_dir, &o, &r->m, err);
}
