/* launch.c — see launch.h. */
#include "transport/launch.h"

#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
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
    /* Unbound by default: tests run 8 ranks on 2 cores. DS_MPIRUN_BIND=core pins one rank per
     * core (the pipeline benchmark: one stage per core). */
    const char *bind = getenv("DS_MPIRUN_BIND");
    av[k++] = "--bind-to";
    av[k++] = (char *)(bind && *bind ? bind : "none");
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

static volatile pid_t g_child = 0;

/* SIGINT/SIGTERM for the job: mpirun would kill the ranks outright, so it gets SIGUSR1 instead,
 * which it hands to every rank; the head shuts down in order and the others follow its plan. */
static void forward_stop(int sig) {
    (void)sig;
    if (g_child > 0) kill(g_child, SIGUSR1);
}

int ds_launch_mpirun_supervised(int n_ranks, int argc, char **argv, int *status, ds_err *err) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) return ds_errf(err, "cannot fork to start mpirun: %s", strerror(errno));
    if (pid == 0) {
        /* Its own process group: a terminal's Ctrl-C reaches only this launcher, which forwards
         * it as above, instead of every rank at once. */
        setpgid(0, 0);
        ds_err e2 = {{0}};
        ds_launch_mpirun(n_ranks, argc, argv, &e2);
        fprintf(stderr, "%s\n", e2.msg);
        _exit(127);
    }
    g_child = pid;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = forward_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return ds_errf(err, "waiting for mpirun: %s", strerror(errno));
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    return DS_OK;
}
