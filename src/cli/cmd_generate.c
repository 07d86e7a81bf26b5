/* cmd_generate.c — `deltaserve generate`: complete one prompt through the engine, as serve would
 * one request. The text streams to stdout as the engine's events bring it; the statistics (prompt
 * and decode tokens, their speed and time) follow on stderr on a line of their own. The engine
 * gives it what serve's requests get: the sampler's defaults, --stop strings, max_tokens capped
 * by the model's context limit, speculative decoding and -tp/-pp (under mpirun, as serve). */
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "cli/ranks.h"
#include "engine/engine.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "transport/comm.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* generate's flags: the engine's (engine_flags.h) and the request's. The sampling numbers are
 * doubles for the parser; their defaults are ds_request_params_default's. */
typedef struct gen_flags {
    ds_engine_flags f;
    ds_request_params rp;
    const char *prompt, *stop;
    int chat, print_ids;
    double temperature, top_p, min_p;
    int64_t seed;
} gen_flags;

enum { GEN_OWN_FLAGS = 12 }; /* entries gen_table adds to the engine's */

static int gen_table(gen_flags *g, ds_arg *out) {
    int n = ds_engine_flags_table(&g->f, out);
    ds_arg own[GEN_OWN_FLAGS] = {
        {"prompt", "p", DS_ARG_STRING, &g->prompt, "TEXT", "prompt text", .required = 1},
        DS_OPT("chat", NULL, DS_ARG_BOOL, &g->chat, NULL,
               "wrap the prompt as a user message in the model's chat format"),
        DS_OPT("max-tokens", "n", DS_ARG_INT, &g->rp.max_tokens, "N",
               "tokens to generate at most (capped by the context limit)"),
        DS_OPT("min-tokens", NULL, DS_ARG_INT, &g->rp.min_tokens, "N",
               "tokens to generate before end of turn or --stop may end the text"),
        DS_OPT("temperature", "t", DS_ARG_FLOAT, &g->temperature, "T", "0 = greedy"),
        DS_OPT("top-p", NULL, DS_ARG_FLOAT, &g->top_p, "P", "nucleus sampling mass (1 = off)"),
        DS_OPT("top-k", NULL, DS_ARG_INT, &g->rp.sample.top_k, "K",
               "keep the K most likely tokens (0 = off)"),
        DS_OPT("min-p", NULL, DS_ARG_FLOAT, &g->min_p, "P",
               "keep tokens at least P times as likely as the most likely (0 = off)"),
        DS_OPT("seed", NULL, DS_ARG_I64, &g->seed, "S", "sampling seed"),
        DS_OPT("stop", NULL, DS_ARG_STRING, &g->stop, "TEXT",
               "end the text where this string appears (it is not printed)"),
        DS_OPT("ignore-eos", NULL, DS_ARG_BOOL, &g->rp.ignore_eos, NULL,
               "do not stop at end of turn"),
        DS_OPT("print-ids", NULL, DS_ARG_BOOL, &g->print_ids, NULL,
               "after the text, the generated token ids on a line of their own (special and "
               "unprintable tokens included)"),
    };
    memcpy(out + n, own, sizeof own);
    return n + GEN_OWN_FLAGS;
}

/* Checks the request's flags and writes them into g->rp; errors name the flag. */
static int gen_apply(gen_flags *g, ds_err *err) {
    ds_request_params *rp = &g->rp;
    if (rp->max_tokens < 1)
        return ds_errf(err, "--max-tokens: expected at least 1, got %d", rp->max_tokens);
    if (rp->min_tokens < 0)
        return ds_errf(err, "--min-tokens: expected at least 0, got %d", rp->min_tokens);
    if (g->temperature < 0)
        return ds_errf(err, "--temperature: expected >= 0, got %g", g->temperature);
    if (g->top_p <= 0 || g->top_p > 1)
        return ds_errf(err, "--top-p: expected 0 < P <= 1, got %g", g->top_p);
    if (g->min_p < 0 || g->min_p > 1)
        return ds_errf(err, "--min-p: expected 0 <= P <= 1, got %g", g->min_p);
    if (g->stop && !g->stop[0]) return ds_errf(err, "--stop: expected a non-empty string");
    rp->sample.temperature = (float)g->temperature;
    rp->sample.top_p = (float)g->top_p;
    rp->sample.min_p = (float)g->min_p;
    rp->has_seed = 1;
    rp->seed = (uint64_t)g->seed;
    if (g->stop) {
        rp->stop[0] = (char *)g->stop; /* argv outlives the request */
        rp->n_stop = 1;
    }
    /* one prompt: one running sequence, and no prefix to share */
    g->f.eo.max_num_seqs = 1;
    g->f.eo.enable_prefix_caching = 0;
    return DS_OK;
}

/* The prompt as token ids: the text as it is, or (--chat) a user message in the chat format. */
static int gen_prompt_ids(const gen_flags *g, ds_engine *e, int32_t **ids, int *n, ds_err *err) {
    const ds_tokenizer *tok = ds_engine_tokenizer(e);
    if (!g->chat) return ds_tok_encode(tok, g->prompt, strlen(g->prompt), 0, ids, n, err);
    json_t *msgs = json_pack("[{s:s, s:s}]", "role", "user", "content", g->prompt);
    char *mj = msgs ? json_dumps(msgs, JSON_COMPACT) : NULL;
    json_decref(msgs);
    if (!mj) return ds_errf(err, "could not build the chat message");
    int rc =
        ds_chat_render(tok, (ds_chat_format)ds_engine_chat_format(e), mj, NULL, NULL, ids, n, err);
    free(mj);
    return rc;
}

/* The request as the engine's events report it (written on the engine thread). */
typedef struct gen_run {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    ds_finish finish;
    int n_prompt, n_generated;
    double t_submit, t_first, t_end; /* ds_now() at submit, at the first token, at the end */
    int32_t *ids;                    /* [cap_ids] generated ids, n_ids of them (--print-ids) */
    int n_ids, cap_ids;
} gen_run;

static void gen_on_event(void *user, const ds_token_event *ev) {
    gen_run *r = user;
    double now = ds_now();
    if (ev->token >= 0) {
        if (r->n_ids == 0) r->t_first = now;
        if (r->n_ids == r->cap_ids) {
            int cap = r->cap_ids ? 2 * r->cap_ids : 64;
            int32_t *nv = realloc(r->ids, (size_t)cap * sizeof *nv);
            if (nv) r->ids = nv, r->cap_ids = cap;
        }
        if (r->n_ids < r->cap_ids) r->ids[r->n_ids++] = ev->token;
    }
    if (ev->text_len) {
        fwrite(ev->text, 1, ev->text_len, stdout);
        fflush(stdout);
    }
    if (ev->finish == DS_FINISH_NONE) return;
    pthread_mutex_lock(&r->mu);
    r->done = 1;
    r->finish = ev->finish;
    r->n_prompt = ev->n_prompt;
    r->n_generated = ev->n_generated;
    r->t_end = now;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* The ids line (--print-ids) on stdout and the statistics line on stderr. */
static void gen_report(const gen_run *r, int print_ids) {
    fprintf(stdout, "\n");
    if (print_ids) {
        for (int i = 0; i < r->n_ids; i++) fprintf(stdout, "%s%d", i ? "," : "ids: ", r->ids[i]);
        fprintf(stdout, "\n");
    }
    fflush(stdout);
    /* the prompt's time runs to its first token; the decode steps made the rest */
    double t_prompt = (r->n_ids ? r->t_first : r->t_end) - r->t_submit;
    double t_decode = r->n_ids ? r->t_end - r->t_first : 0;
    int steps = r->n_generated > 1 ? r->n_generated - 1 : 0;
    fprintf(stderr,
            "[deltaserve] prompt %d tokens, %.1f tok/s, %.3f s | decode %d tokens, %.1f tok/s, "
            "%.3f s | finish %s\n",
            r->n_prompt, t_prompt > 0 ? r->n_prompt / t_prompt : 0.0, t_prompt, steps,
            steps && t_decode > 0 ? steps / t_decode : 0.0, t_decode, ds_finish_name(r->finish));
}

/* The head rank: the engine, the one request, its text and statistics. Returns the status. */
static int gen_head(gen_flags *g) {
    ds_err err = {{0}};
    ds_engine *e = NULL;
    int32_t *ids = NULL;
    int n = 0, status = 1;
    gen_run r = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    if (ds_engine_create(&g->f.eo, &e, &err) || ds_engine_start(e, &err) ||
        gen_prompt_ids(g, e, &ids, &n, &err))
        goto out;
    if (n == 0) {
        ds_errf(&err, "--prompt: the prompt is empty");
        goto out;
    }
    ds_request_spec spec = {ids, n, g->rp, gen_on_event, &r, 0, NULL};
    r.t_submit = ds_now();
    if (ds_engine_submit(e, &spec, NULL, &err) < 0) goto out;
    pthread_mutex_lock(&r.mu);
    while (!r.done) pthread_cond_wait(&r.cv, &r.mu);
    pthread_mutex_unlock(&r.mu);
    gen_report(&r, g->print_ids);
    status = r.finish == DS_FINISH_ERROR;
    if (status) ds_errf(&err, "the engine failed the request");
out:
    if (status) {
        ds_comm *c = g->f.eo.comm;
        fprintf(stderr, "generate: %s%s%s\n", c->size > 1 ? c->who : "", c->size > 1 ? ": " : "",
                err.msg);
    }
    ds_engine_free(e); /* stops the engine, and with it the job's other ranks */
    free(ids);
    free(r.ids);
    return status;
}

int ds_cmd_generate(int argc, char **argv) {
    static gen_flags g; /* its test hooks' state outlives the engine */
    memset(&g, 0, sizeof g);
    if (ds_engine_flags_init(&g.f, "generate")) return 2;
    ds_request_params_default(&g.rp);
    g.temperature = g.rp.sample.temperature;
    g.top_p = g.rp.sample.top_p;
    g.min_p = g.rp.sample.min_p;
    g.seed = (int64_t)g.rp.seed;
    ds_arg opts[DS_ENGINE_FLAGS_MAX + GEN_OWN_FLAGS];
    ds_args a = {"deltaserve generate",
                 "Complete one prompt through the engine: the text streams to stdout, then the\n"
                 "prompt and decode speed go to stderr on a line of their own.",
                 opts, gen_table(&g, opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    ds_err err = {{0}};
    if (ds_engine_flags_apply(&g.f, &a, &err) || gen_apply(&g, &err)) {
        if (!ds_rank_quiet()) fprintf(stderr, "generate: %s\n", err.msg);
        ds_engine_flags_free(&g.f);
        return 2;
    }
    if ((rc = ds_engine_flags_job(&g.f, 0, argc, argv)) >= 0) {
        ds_engine_flags_free(&g.f);
        return rc;
    }
    ds_comm *comm = g.f.eo.comm;
    if (comm->rank != 0) return ds_engine_flags_run_rank(&g.f);
    int status = gen_head(&g);
    ds_engine_flags_free(&g.f);
    return ds_comm_finish(comm, status);
}
