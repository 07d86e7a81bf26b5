/* ranks.h — one rank's part of a `-tp T -pp P` command (logits, bench): its comm and its slice of
 * the model. */
#ifndef DS_CLI_RANKS_H
#define DS_CLI_RANKS_H

#include "transport/comm.h"
#include "model/model.h"

typedef struct ds_rank {
    ds_comm *comm;
    ds_model *m;
    int first, last; /* this rank's stage is the first / the last */
} ds_rank;

/* Usage errors are the same on every rank of a job: only world rank 0 (or a lone process) says
 * so. True on the others. */
int ds_rank_quiet(void);

/* Before a `cmd -tp T -pp P` job's ranks exist: checks the split into counts[P] (a usage error,
 * said once: returns 2) and, for more than one rank outside mpirun, runs the command again
 * through mpirun (returns its failure, 1). -1: go on, as a rank of the job or alone. */
int ds_rank_prepare(const char *cmd, const char *model_dir, int tp, int pp, const char *partition,
                    int *counts, int argc, char **argv);

/* Joins the job (MPI when started by mpirun, else a local comm) and loads this rank's stage
 * (layers per stage in counts[pp], from ds_pp_check_split) and TP slice, with base's other
 * options. Rank r of a host uses GPU r mod count. */
int ds_rank_open(const char *model_dir, int tp, int pp, const int *counts,
                 const ds_model_opts *base, ds_rank *r, ds_err *err);

#endif
