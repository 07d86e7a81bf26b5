/* launch.c — see launch.h. */
#include "dist/launch.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int ds_launch_mpirun(int n_ranks, int argc, char **argv, ds_err *err) {
    char exe[4096];
    /* /proc/self/exe must be resolved here: passed as is, each rank's launcher would resolve it
     * to its own executable. */
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) return ds_errf(err, "cannot find this executable: %s", strerror(errno));
    exe[len] = 0;
    const char *mpirun = getenv("DS_MPIRUN");
    if (!mpirun || !*mpirun) mpirun = "mpirun";
    char *extra = strdup(getenv("DS_MPIRUN_ARGS") ? getenv("DS_MPIRUN_ARGS") : "");
    if (!extra) return ds_errf(err, "out of memory");
    int n_extra = 0;
    for (char *p = extra; *p;) { /* count words */
        while (*p == ' ') p++;
        if (!*p) break;
        n_extra++;
        while (*p && *p != ' ') p++;
    }
    char **av = ds_calloc((size_t)(argc + n_extra + 12), sizeof *av, err);
    if (!av) {
        free(extra);
        return DS_ERR;
    }
    char np[16];
    snprintf(np, sizeof np, "%d", n_ranks);
    int k = 0;
    av[k++] = (char *)mpirun;
    av[k++] = "-np";
    av[k++] = np;
    av[k++] = "--oversubscribe";
    av[k++] = "--bind-to";
    av[k++] = "none";
    if (geteuid() == 0) av[k++] = "--allow-run-as-root";
    for (char *p = strtok(extra, " "); p; p = strtok(NULL, " ")) av[k++] = p;
    av[k++] = exe;
    for (int i = 0; i < argc; i++) av[k++] = argv[i];
    av[k] = NULL;
    if (!getenv("OMP_NUM_THREADS")) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        char t[24];
        snprintf(t, sizeof t, "%ld", cores / n_ranks > 1 ? cores / n_ranks : 1);
        setenv("OMP_NUM_THREADS", t, 1);
    }
    fflush(stdout);
    fflush(stderr);
    execvp(mpirun, av);
    int e = errno;
    free(av);
    free(extra);
    return ds_errf(err,
                   "cannot start '%s' for %d ranks: %s (install Open MPI's mpirun, or set "
                   "DS_MPIRUN)",
                   mpirun, n_ranks, strerror(e));
}
