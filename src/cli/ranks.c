/* ranks.c — see ranks.h. */
#include "cli/ranks.h"

#include "transport/launch.h"
#include "parallel/pipeline.h"

#include <stdio.h>

#include <stdlib.h>
#include <string.h>

int ds_rank_quiet(void) {
    const char *wr = getenv("OMPI_COMM_WORLD_RANK");
    return wr && atoi(wr) != 0;
}

int ds_rank_prepare(const char *cmd, const char *model_dir, int tp, int pp, const char *partition,
                    int *counts, int argc, char **argv) {
    ds_err err = {{0}};
    if (ds_pp_check_split(model_dir, tp, pp, partition, counts, &err)) {
        if (!ds_rank_quiet()) fprintf(stderr, "%s: %s\n", cmd, err.msg);
        return 2;
    }
    if (tp * pp > 1 && !ds_comm_under_mpirun()) {
        ds_launch_mpirun(tp * pp, argc, argv, &err);
        fprintf(stderr, "%s: %s\n", cmd, err.msg);
        return 1;
    }
    return -1;
}

int ds_rank_open(const char *model_dir, int tp, int pp, const int *counts,
                 const ds_model_opts *base, ds_rank *r, ds_err *err) {
    memset(r, 0, sizeof *r);
    if (ds_comm_init(tp, pp, &r->comm, err)) return DS_ERR;
    ds_model_opts o = *base;
    /* one GPU per rank of a host, as the engine picks it */
    if (r->comm->size > 1) o.device_index = ds_comm_local_rank(r->comm);
    ds_pp_rank_opts(r->comm, counts, &o);
    r->first = r->comm->stage == 0;
    r->last = r->comm->stage == pp - 1;
    return ds_model_load(model_dir, &o, &r->m, err);
}
