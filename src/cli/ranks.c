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
    ds_pp_rank_opts(r->comm, counts, &o);
    r->first = r->comm->stage == 0;
    r->last = r->comm->stage == pp - 1;
    return ds_model_load(model_dir, &o, &r->m, err);
}
