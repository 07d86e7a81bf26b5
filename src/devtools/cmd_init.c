/* cmd_init.c — `deltaserve init-model`: writes a random-initialised checkpoint (init_model.h). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cli/args.h"
#include "cli/commands.h"
#include "devtools/init_model.h"

/* 1 if dir exists and holds any entry besides . and .. */
static int dir_nonempty(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while (!found && (e = readdir(d)) != NULL)
        found = strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return found;
}

int ds_cmd_init_model(int argc, char **argv) {
    const char *preset = "tiny-k3", *out = NULL, *experts = "bf16", *shape = NULL;
    static const char *const expert_formats[] = {"bf16", "mxfp4", NULL};
    int64_t seed = 0;
    int force = 0;
    static char summary[1024];
    int k = snprintf(summary, sizeof summary,
                     "Write a random-initialised checkpoint in the Hugging Face layout\n"
                     "(config.json, safetensors, tiktoken.model, tokenizer_config.json).\n"
                     "The bytes depend only on the preset and the seed.\n\npresets:");
    for (const char *const *p = ds_init_model_presets(); *p && k > 0 && (size_t)k < sizeof summary;
         p++)
        k += snprintf(summary + k, sizeof summary - (size_t)k, "\n  %-12s %s", *p,
                      ds_init_model_describe(*p));
    ds_arg opts[] = {
        {"preset", "p", DS_ARG_STRING, &preset, "NAME", "model preset",
         .choices = ds_init_model_presets()},
        {"out", "o", DS_ARG_STRING, &out, "DIR", "output folder (created if missing)",
         .required = 1},
        DS_OPT("seed", NULL, DS_ARG_I64, &seed, "N", "RNG seed"),
        {"experts", NULL, DS_ARG_STRING, &experts, "F",
         "routed experts: bf16, or mxfp4 (compressed-tensors, as Kimi-K3 ships them)",
         .choices = expert_formats},
        DS_OPT("force", "f", DS_ARG_BOOL, &force, NULL, "write into a non-empty folder"),
        DS_OPT("shape-of", NULL, DS_ARG_STRING, &shape, "DIR",
               "instead of a preset: DIR's config.json and a tokenizer of its vocabulary, no "
               "weights (serve it with --load-format dummy)"),
    };
    ds_args a = {"deltaserve init-model", summary, opts, (int)DS_ARRAY_LEN(opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;

    if (!force && dir_nonempty(out)) {
        fprintf(stderr, "deltaserve init-model: %s is not empty (use --force to write into it)\n",
                out);
        return 1;
    }
    ds_err err = {{0}};
    double t0 = ds_now();
    if (shape ? ds_init_shape(shape, out, &err)
              : ds_init_model_ex(preset, out, (uint64_t)seed, !strcmp(experts, "mxfp4"), &err)) {
        fprintf(stderr, "deltaserve init-model: %s\n", err.msg);
        return 1;
    }
    if (shape)
        printf("wrote %s (the shape of %s: config and tokenizer, no weights) in %.1f s\n", out,
               shape, ds_now() - t0);
    else
        printf("wrote %s (preset %s, seed %lld) in %.1f s\n", out, preset, (long long)seed,
               ds_now() - t0);
    return 0;
}
