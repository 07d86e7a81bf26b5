/* main.c — `deltaserve <command> [flags]`: picks the subcommand and hands it the rest of argv.
 * Only here (and in the commands' return values) does the process decide its exit status. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/ds_base.h"
#include "cli/commands.h"

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command COMMANDS[] = {
    {"serve", ds_cmd_serve, "serve an OpenAI-compatible HTTP API (completions, chat, streaming)"},
    {"generate", ds_cmd_generate, "complete a prompt and print the text"},
    {"logits", ds_cmd_logits, "print the logits a model gives a prompt"},
    {"bench", ds_cmd_bench, "measure prefill/decode throughput against the machine's limits"},
    {"tokenize", ds_cmd_tokenize, "encode text to token ids, or decode ids to text"},
    {"init-model", ds_cmd_init_model, "write a random-initialised checkpoint from a preset"},
};

static void print_usage(FILE *f) {
    fprintf(f, "usage: deltaserve <command> [options]\n\n"
               "A serving engine for kimi_linear-family models (Kimi-Linear, Kimi-K3).\n\n"
               "commands:\n");
    for (size_t i = 0; i < DS_ARRAY_LEN(COMMANDS); i++)
        fprintf(f, "  %-12s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
    fprintf(f, "\nRun 'deltaserve <command> --help' for a command's options.\n");
}

static const command *find_command(const char *name) {
    for (size_t i = 0; i < DS_ARRAY_LEN(COMMANDS); i++)
        if (strcmp(COMMANDS[i].name, name) == 0) return &COMMANDS[i];
    return NULL;
}

/* How OpenMP threads wait between parallel regions. Spinning without bound steals the CPU from
 * whatever else runs (the HTTP threads, other processes, other MPI ranks): on a loaded 2-core
 * machine a decode step was measured many times slower with libgomp's default active waiting than
 * with passive waiting, and 4 ranks of -pp 2 -tp 2 on 2 cores served several times slower with
 * even a short spin. Sleeping at once costs a futex wake-up and a core's exit from idle for every
 * one of a step's hundreds of regions: on this 2-core machine a gsm-k3 decode step of one row,
 * and a DSpark server, were several times slower passive than with a short spin first
 * (GOMP_SPINCOUNT=10000; bench/RESULTS.md, "Figures moved out of source comments"). So: passive,
 * with that short spin when this process's threads have the CPUs to themselves — its MPI ranks on
 * this host (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS) times OMP_NUM_THREADS
 * at most the CPUs it may run on. A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT stands. libgomp reads
 * them when it loads, before main, so we set them and run ourselves again; DS_OMP_WAIT_PID marks
 * the process that chose (a rank started by mpirun inherits its launcher's choice and chooses
 * again for itself). */
static int env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    int n = v && *v ? atoi(v) : 0;
    return n > 0 ? n : dflt;
}

static void choose_wait_policy(char **argv) {
    const char *marker = getenv("DS_OMP_WAIT_PID");
    char pid[24];
    snprintf(pid, sizeof pid, "%ld", (long)getpid());
    if (marker && strcmp(marker, pid) == 0) return; /* chosen, and running again */
    if (marker) {                                   /* an ancestor's choice: choose again */
        unsetenv("OMP_WAIT_POLICY");
        unsetenv("GOMP_SPINCOUNT");
    } else if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT")) {
        return; /* the user's */
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) cpus = CPU_COUNT(&set);
    const long ranks = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", env_int("MPI_LOCALNRANKS", 1));
    const long threads = env_int("OMP_NUM_THREADS", (int)(cpus > 0 ? cpus : 1));
    setenv("OMP_WAIT_POLICY", "passive", 1);
    if (ranks * threads <= cpus) setenv("GOMP_SPINCOUNT", "10000", 1);
    setenv("DS_OMP_WAIT_PID", pid, 1);
    execv("/proc/self/exe", argv);
    /* exec failed: carry on with the default policy */
}

int main(int argc, char **argv) {
    choose_wait_policy(argv);
    if (argc < 2) {
        print_usage(stderr);
        return 2;
    }
    const char *name = argv[1];
    if (strcmp(name, "-h") == 0 || strcmp(name, "--help") == 0) {
        print_usage(stdout);
        return 0;
    }
    if (strcmp(name, "help") == 0) { /* `deltaserve help CMD` == `deltaserve CMD --help` */
        if (argc < 3) {
            print_usage(stdout);
            return 0;
        }
        name = argv[2];
        argv[2] = "--help";
        argc = 3;
    }
    const command *c = find_command(name);
    if (!c) {
        fprintf(stderr, "deltaserve: unknown command '%s' (run 'deltaserve --help' for the list)\n",
                name);
        return 2;
    }
    argv[1] = (char *)c->name;
    return c->run(argc - 1, argv + 1);
}
