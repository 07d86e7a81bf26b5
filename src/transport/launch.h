/* launch.h — `deltaserve CMD -tp T -pp P` started without mpirun re-launches itself under mpirun
 * with T * P ranks on this host (docs/parallelism.md, "Process model"). Across hosts, start it
 * through mpirun yourself: `mpirun -np 8 --hostfile hosts deltaserve CMD -tp 4 -pp 2`. */
#ifndef DS_LAUNCH_H
#define DS_LAUNCH_H

#include "base/ds_base.h"

/* Replaces this process with
 *   $DS_MPIRUN -np N --oversubscribe --bind-to none [--allow-run-as-root] $DS_MPIRUN_ARGS EXE ARGS
 * where EXE is this executable and ARGS = argv[0 .. argc) (argv[0] is the command name, as main
 * hands it to a command). DS_MPIRUN defaults to "mpirun".
 * Why those options: every rank lands on this host, so oversubscription is what was asked for;
 * binding each rank to one core would pile all of a rank's OpenMP threads onto that core; root
 * is refused by Open MPI unless told. When OMP_NUM_THREADS is unset it is set to the host's cores
 * / N (at least 1) so the ranks do not each start a thread per core.
 * Returns only on failure (mpirun not found), with the message in err. */
int ds_launch_mpirun(int n_ranks, int argc, char **argv, ds_err *err);

/* The same as a child process that this one supervises, for long-running jobs (serve): SIGINT
 * and SIGTERM reach the job as SIGUSR1, which mpirun forwards to every rank (the head then shuts
 * down in order; killing mpirun would kill the ranks mid-request). *status: mpirun's exit status
 * (128 + signal when it was killed). */
int ds_launch_mpirun_supervised(int n_ranks, int argc, char **argv, int *status, ds_err *err);

#endif
