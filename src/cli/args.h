/* args.h — a small flag parser for the subcommands.
 *
 * A command describes its flags in a table of ds_arg, each pointing at the variable it fills; the
 * variable's value before parsing is the default and is what --help shows. Accepted forms:
 *   --name VALUE   --name=VALUE   -alias VALUE   -alias=VALUE
 *   --flag  --no-flag  --flag=true|false|1|0|yes|no|on|off      (bool flags only)
 * `-h`/`--help` prints the help. Errors name the flag and what was expected, e.g.
 * "--max-tokens: expected an integer, got 'abc'". A value that starts with "--" must use the
 * --name=VALUE form (so a forgotten value is not silently replaced by the next flag).
 *
 * Typical use in a command:
 *     int max_tokens = 64;
 *     const char *model = NULL;
 *     ds_arg opts[] = {
 *         {"model", "m", DS_ARG_STRING, &model, "DIR", "checkpoint folder", .required = 1},
 *         DS_OPT("max-tokens", "n", DS_ARG_INT, &max_tokens, "N", "tokens to generate"),
 *     };
 * (-Wextra wants every field of a positional initializer: use DS_OPT, or end the entry with a
 * designated field such as .required or .choices.)
 *     ds_args a = {"deltaserve generate", "Generate text from a prompt.", opts,
 *                  DS_ARRAY_LEN(opts)};
 *     int rc;
 *     if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;   // --help (0) or bad flags (2)
 */
#ifndef DS_ARGS_H
#define DS_ARGS_H

#include <stdint.h>
#include <stdio.h>

#include "base/ds_base.h"

typedef enum {
    DS_ARG_INT,    /* int *       */
    DS_ARG_I64,    /* int64_t *   */
    DS_ARG_FLOAT,  /* double *    */
    DS_ARG_STRING, /* const char ** (points into argv) */
    DS_ARG_BOOL,   /* int * (0/1) */
} ds_arg_type;

typedef struct ds_arg {
    const char *name;  /* long name without dashes: "max-tokens" */
    const char *alias; /* short alias without the dash ("n", "tp"), or NULL */
    ds_arg_type type;
    void *dest;                 /* see ds_arg_type; its current value is the default */
    const char *metavar;        /* value placeholder in help ("N", "DIR"); NULL: from the type */
    const char *help;           /* one line */
    int required;               /* must be given */
    const char *const *choices; /* DS_ARG_STRING only: NULL-terminated allowed values, or NULL */
    int hidden; /* parsed like any other flag but not listed by --help: test hooks only */
    int seen;   /* set by the parser: given on the command line */
} ds_arg;

/* An optional flag with no choices. */
#define DS_OPT(name_, alias_, type_, dest_, metavar_, help_)                                       \
    {                                                                                              \
        .name = (name_), .alias = (alias_), .type = (type_), .dest = (dest_),                      \
        .metavar = (metavar_), .help = (help_)                                                     \
    }

/* A flag that exists for the tests (cli/test_hooks.h): it works, --help does not list it. */
#define DS_TEST_OPT(name_, type_, dest_, metavar_, help_)                                          \
    {                                                                                              \
        .name = (name_), .type = (type_), .dest = (dest_), .metavar = (metavar_), .help = (help_), \
        .hidden = 1                                                                                \
    }

typedef struct ds_args {
    const char *prog;    /* "deltaserve generate" */
    const char *summary; /* one or more lines printed under the usage line */
    ds_arg *opts;
    int n_opts;
} ds_args;

#define DS_ARGS_HELP 1 /* ds_args_parse's result when -h/--help was given */

/* Parses argv[1..argc-1] (argv[0] is the command name). Returns DS_OK, DS_ARGS_HELP (nothing is
 * assigned then, so the help shows the defaults), or DS_ERR with a message naming the flag.
 * Positional arguments are errors. A flag given twice keeps the last value. */
int ds_args_parse(ds_args *a, int argc, char **argv, ds_err *err);

/* Was the flag with this long name given on the command line (after ds_args_parse)? 0 for a name
 * the table does not have. */
int ds_args_seen(const ds_args *a, const char *name);

/* Prints usage, summary and one line per flag with its default (or "required"); hidden flags are
 * left out. */
void ds_args_print_help(const ds_args *a, FILE *f);

/* ds_args_parse for a command's entry point. Returns 0 to go on; otherwise the command should
 * return *exit_code: 0 after printing the help to stdout, 2 after printing the error (and a hint to
 * use --help) to stderr. */
int ds_args_parse_cli(ds_args *a, int argc, char **argv, int *exit_code);

#endif
