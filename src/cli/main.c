/* main.c — `deltaserve <command> [flags]`: picks the subcommand and hands it the rest of argv.
 * Only here (and in the commands' return values) does the process decide its exit status. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/ds_base.h"
#include "cli/commands.h"

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv); /* NULL: not implemented yet */
    const char *summary;
} command;

static const command COMMANDS[] = {
    {"serve", ds_cmd_serve, "serve an OpenAI-compatible HTTP API (completions, chat, streaming)"},
    {"generate", ds_cmd_generate, "complete a prompt and print the text"},
    {"logits", ds_cmd_logits, "print the logits a model gives a prompt"},
    {"bench", ds_cmd_bench, "measure prefill/decode throughput against the machine's limits"},
    {"eval", NULL, "run evaluation tasks against a model"},
    {"tokenize", ds_cmd_tokenize, "encode text to token ids, or decode ids to text"},
    {"init-model", ds_cmd_init_model, "write a random-initialised checkpoint from a preset"},
};

static void print_usage(FILE *f) {
    fprintf(f, "usage: deltaserve <command> [options]\n\n"
               "A serving engine for kimi_linear-family models (Kimi-Linear, Kimi-K3).\n\n"
               "commands:\n");
    for (size_t i = 0; i < DS_ARRAY_LEN(COMMANDS); i++)
        fprintf(f, "  %-12s %s%s\n", COMMANDS[i].name, COMMANDS[i].summary,
                COMMANDS[i].run ? "" : " (not implemented yet)");
    fprintf(f, "\nRun 'deltaserve <command> --help' for a command's options.\n");
}

static const command *find_command(const char *name) {
    for (size_t i = 0; i < DS_ARRAY_LEN(COMMANDS); i++)
        if (strcmp(COMMANDS[i].name, name) == 0) return &COMMANDS[i];
    return NULL;
}

/* OpenMP threads that spin while they wait for work steal the CPU from whatever else runs (the
 * HTTP threads, other processes, other MPI ranks): on a loaded 2-core machine a decode step was
 * measured 10x slower with libgomp's default active waiting than with passive waiting. libgomp
 * reads OMP_WAIT_POLICY when it loads, before main, so when the user has not chosen one we set
 * it and run ourselves again. */
static void prefer_passive_wait(char **argv) {
    if (getenv("OMP_WAIT_POLICY")) return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);
    /* exec failed: carry on with the default policy */
}

int main(int argc, char **argv) {
    prefer_passive_wait(argv);
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
    if (!c->run) {
        int help = argc >= 3 && (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0);
        fprintf(help ? stdout : stderr,
                "usage: deltaserve %s [options]\n\n%s\n\n%s: not implemented yet\n", c->name,
                c->summary, c->name);
        return help ? 0 : 2;
    }
    argv[1] = (char *)c->name;
    return c->run(argc - 1, argv + 1);
}
