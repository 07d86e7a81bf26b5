/* args.c — see args.h. Parsing runs in two passes: the first matches every token to a flag and
 * finds its value string (and spots --help before anything is assigned), the second converts and
 * stores the values in command-line order. */
#include "cli/args.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* One matched flag occurrence. */
typedef struct match {
    ds_arg *opt;
    const char *value; /* NULL for a bare bool flag */
    int negated;       /* --no-flag */
} match;

static const char *type_metavar(ds_arg_type t) {
    switch (t) {
    case DS_ARG_INT:
    case DS_ARG_I64:
        return "N";
    case DS_ARG_FLOAT:
        return "X";
    case DS_ARG_STRING:
        return "S";
    case DS_ARG_BOOL:
        return "";
    }
    return "";
}

/* Finds the option spelled by `body` (the text after the dashes, before any '='). */
static ds_arg *find_opt(ds_args *a, const char *body, size_t len, int is_long, int *negated) {
    *negated = 0;
    for (int i = 0; i < a->n_opts; i++) {
        ds_arg *o = &a->opts[i];
        const char *n = is_long ? o->name : o->alias;
        if (n && strlen(n) == len && strncmp(n, body, len) == 0) return o;
    }
    if (is_long && len > 3 && strncmp(body, "no-", 3) == 0) {
        for (int i = 0; i < a->n_opts; i++) {
            ds_arg *o = &a->opts[i];
            if (o->type == DS_ARG_BOOL && strlen(o->name) == len - 3 &&
                strncmp(o->name, body + 3, len - 3) == 0) {
                *negated = 1;
                return o;
            }
        }
    }
    return NULL;
}

static int parse_bool(const char *s, int *out) {
    static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no",
                                                                                "off"};
    for (size_t i = 0; i < DS_ARRAY_LEN(yes); i++) {
        if (strcasecmp(s, yes[i]) == 0) return *out = 1, DS_OK;
        if (strcasecmp(s, no[i]) == 0) return *out = 0, DS_OK;
    }
    return DS_ERR;
}

/* Converts m->value into m->opt->dest. Messages name the flag by its long form. */
static int assign(const match *m, ds_err *err) {
    ds_arg *o = m->opt;
    const char *v = m->value;
    char *end = NULL;
    errno = 0;
    switch (o->type) {
    case DS_ARG_INT:
    case DS_ARG_I64: {
        long long x = strtoll(v, &end, 10);
        int bad = *v == 0 || *end != 0 || errno == ERANGE;
        if (o->type == DS_ARG_INT && (x < INT_MIN || x > INT_MAX)) bad = 1;
        if (bad) return ds_errf(err, "--%s: expected an integer, got '%s'", o->name, v);
        if (o->type == DS_ARG_INT)
            *(int *)o->dest = (int)x;
        else
            *(int64_t *)o->dest = (int64_t)x;
        break;
    }
    case DS_ARG_FLOAT: {
        double x = strtod(v, &end);
        if (*v == 0 || *end != 0 || !isfinite(x))
            return ds_errf(err, "--%s: expected a number, got '%s'", o->name, v);
        *(double *)o->dest = x;
        break;
    }
    case DS_ARG_STRING:
        if (o->choices) {
            int ok = 0;
            for (const char *const *c = o->choices; *c && !ok; c++) ok = strcmp(*c, v) == 0;
            if (!ok) {
                char list[512] = "";
                for (const char *const *c = o->choices; *c; c++)
                    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                             c == o->choices ? "" : ", ", *c);
                return ds_errf(err, "--%s: expected one of %s, got '%s'", o->name, list, v);
            }
        }
        *(const char **)o->dest = v;
        break;
    case DS_ARG_BOOL: {
        int b = 1;
        if (v && parse_bool(v, &b) != DS_OK)
            return ds_errf(err, "--%s: expected true or false, got '%s'", o->name, v);
        *(int *)o->dest = m->negated ? !b : b;
        break;
    }
    }
    o->seen = 1;
    return DS_OK;
}

int ds_args_parse(ds_args *a, int argc, char **argv, ds_err *err) {
    match *ms = ds_calloc((size_t)(argc > 0 ? argc : 1), sizeof *ms, err);
    if (!ms) return DS_ERR;
    int n = 0, rc = DS_OK, help = 0;
    for (int i = 0; i < a->n_opts; i++) a->opts[i].seen = 0;

    for (int i = 1; i < argc && rc == DS_OK && !help; i++) {
        const char *tok = argv[i];
        if (strcmp(tok, "-h") == 0 || strcmp(tok, "--help") == 0) {
            help = 1;
            break;
        }
        if (tok[0] != '-' || tok[1] == 0 || (tok[1] == '-' && tok[2] == 0)) {
            rc = ds_errf(err, "unexpected argument '%s'", tok);
            break;
        }
        int is_long = tok[1] == '-';
        const char *body = tok + (is_long ? 2 : 1), *eq = strchr(body, '=');
        size_t len = eq ? (size_t)(eq - body) : strlen(body);
        match *m = &ms[n];
        m->opt = find_opt(a, body, len, is_long, &m->negated);
        if (!m->opt) {
            rc = ds_errf(err, "unknown flag '%.*s'", (int)(len + (is_long ? 2 : 1)), tok);
            break;
        }
        if (eq) {
            m->value = eq + 1;
            if (m->negated) {
                rc = ds_errf(err, "%.*s: takes no value", (int)(len + 2), tok);
                break;
            }
        } else if (m->opt->type != DS_ARG_BOOL) {
            if (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0) {
                rc = ds_errf(err, "--%s: expected a value (%s)", m->opt->name,
                             m->opt->metavar ? m->opt->metavar : type_metavar(m->opt->type));
                break;
            }
            m->value = argv[++i];
        }
        n++;
    }
    if (help) rc = DS_ARGS_HELP;
    for (int k = 0; k < n && rc == DS_OK; k++) rc = assign(&ms[k], err);
    for (int i = 0; i < a->n_opts && rc == DS_OK; i++)
        if (a->opts[i].required && !a->opts[i].seen)
            rc = ds_errf(err, "--%s is required", a->opts[i].name);
    free(ms);
    return rc;
}

int ds_args_seen(const ds_args *a, const char *name) {
    for (int i = 0; i < a->n_opts; i++)
        if (strcmp(a->opts[i].name, name) == 0) return a->opts[i].seen;
    return 0;
}

/* The current value of o as text (for "default: ..."); "" when there is none worth showing. */
static void format_default(const ds_arg *o, char *buf, size_t cap) {
    switch (o->type) {
    case DS_ARG_INT:
        snprintf(buf, cap, "%d", *(const int *)o->dest);
        break;
    case DS_ARG_I64:
        snprintf(buf, cap, "%" PRId64, *(const int64_t *)o->dest);
        break;
    case DS_ARG_FLOAT:
        snprintf(buf, cap, "%g", *(const double *)o->dest);
        break;
    case DS_ARG_STRING: {
        const char *s = *(const char *const *)o->dest;
        snprintf(buf, cap, "%s", s ? s : "");
        break;
    }
    case DS_ARG_BOOL:
        snprintf(buf, cap, "%s", *(const int *)o->dest ? "true" : "false");
        break;
    }
}

/* The left column of o's help line: "-a, --name METAVAR" or "--flag, --no-flag". */
static void format_left(const ds_arg *o, char *buf, size_t cap) {
    int k = o->alias ? snprintf(buf, cap, "-%s, ", o->alias) : 0;
    if (k < 0 || (size_t)k >= cap) k = 0;
    if (o->type == DS_ARG_BOOL)
        snprintf(buf + k, cap - (size_t)k, "--%s, --no-%s", o->name, o->name);
    else
        snprintf(buf + k, cap - (size_t)k, "--%s %s", o->name,
                 o->metavar ? o->metavar : type_metavar(o->type));
}

void ds_args_print_help(const ds_args *a, FILE *f) {
    char left[160], def[256];
    int width = 12; /* "-h, --help" */
    for (int i = 0; i < a->n_opts; i++) {
        if (a->opts[i].hidden) continue;
        format_left(&a->opts[i], left, sizeof left);
        width = DS_MAX(width, (int)strlen(left));
    }
    width = DS_MIN(width, 40) + 2;
    fprintf(f, "usage: %s [options]\n\n%s\n\noptions:\n", a->prog, a->summary ? a->summary : "");
    for (int i = 0; i < a->n_opts; i++) {
        const ds_arg *o = &a->opts[i];
        if (o->hidden) continue;
        format_left(o, left, sizeof left);
        format_default(o, def, sizeof def);
        fprintf(f, "  %-*s %s", width, left, o->help ? o->help : "");
        if (o->choices) {
            fputs(" (one of:", f);
            for (const char *const *c = o->choices; *c; c++) fprintf(f, " %s", *c);
            fputc(')', f);
        }
        if (o->required)
            fputs(" (required)", f);
        else if (def[0])
            fprintf(f, " (default: %s)", def);
        fputc('\n', f);
    }
    fprintf(f, "  %-*s %s\n", width, "-h, --help", "show this help and exit");
}

int ds_args_parse_cli(ds_args *a, int argc, char **argv, int *exit_code) {
    ds_err err = {{0}};
    int rc = ds_args_parse(a, argc, argv, &err);
    if (rc == DS_OK) return 0;
    if (rc == DS_ARGS_HELP) {
        ds_args_print_help(a, stdout);
        *exit_code = 0;
    } else {
        fprintf(stderr, "%s: %s\n(run '%s --help' for the list of flags)\n", a->prog, err.msg,
                a->prog);
        *exit_code = 2;
    }
    return 1;
}
