/* cmd_generate.c — `deltaserve generate` (stream a completion of one prompt) and
 * `deltaserve logits` (teacher-forced logits of a token sequence, as .npy). Both run one sequence
 * directly on the model, with its own state slot and a private latent pool sized for the request.
 */
#include "base/devmem.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/ranks.h"
#include "transport/comm.h"
#include "parallel/pipeline.h"
#include "sample/sampler.h"
#include "text/chat.h"
#include "model/model.h"
#include "text/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { GEN_BLOCK = 64, PREFILL_CHUNK = 512 };

/* A single sequence's cache: one KDA slot and a latent pool of just enough pages. */
typedef struct one_seq {
    ds_kv_pool pool;
    int32_t *table; /* [n_pages] identity block table */
    float *slot;    /* [ds_model_slot_floats], on the model's device */
    int on_device;
} one_seq;

static int one_seq_init(one_seq *s, const ds_model *m, int max_ctx, ds_err *err) {
    memset(s, 0, sizeof *s);
    int n_pages = (max_ctx + GEN_BLOCK - 1) / GEN_BLOCK;
    if (ds_kv_pool_init(&s->pool, m, n_pages, GEN_BLOCK, err)) return DS_ERR;
    s->table = ds_malloc((size_t)n_pages * sizeof(int32_t), err);
    size_t bytes = ds_model_slot_floats(m) * sizeof(float);
    s->on_device = ds_model_on_device(m);
    s->slot = ds_dmem_alloc(s->on_device, bytes, err);
    if (!s->table || !s->slot) return DS_ERR;
    ds_dmem_zero(s->on_device, s->slot, bytes); /* a new sequence starts from the zero state */
    for (int i = 0; i < n_pages; i++) s->table[i] = i;
    return DS_OK;
}

static void one_seq_free(one_seq *s) {
    ds_kv_pool_free(&s->pool);
    free(s->table);
    ds_dmem_free(s->on_device, s->slot);
}

/* Feeds ids[0..n) at positions pos0.. in chunks; logits of the last token into `last`. */
static int feed(ds_model *m, one_seq *s, const int32_t *ids, int n, int pos0, float *last,
                ds_err *err) {
    for (int done = 0; done < n;) {
        int len = DS_MIN(PREFILL_CHUNK, n - done);
        int is_last = done + len == n;
        ds_seq_batch sb = {ids + done, len,  pos0 + done, s->slot, s->table, is_last ? last : NULL,
                           is_last,    NULL, NULL,        NULL,    0,        NULL,
                           NULL,       NULL, NULL};
        if (ds_model_forward(m, &s->pool, &sb, 1, err)) return DS_ERR;
        done += len;
    }
    return DS_OK;
}

/* --device's default: cpu, or DS_DEVICE (an unknown name there is taken for cpu: the flag, or
 * serve, names it). */
static const char *default_device(void) {
    ds_model_opts o;
    ds_model_opts_default(&o);
    return ds_device_names[o.device < 0 ? DS_DEVICE_CPU : o.device];
}

int ds_cmd_generate(int argc, char **argv) {
    const char *model_dir = NULL, *prompt = NULL, *device = default_device();
    int chat = 0, max_tokens = 64, top_k = 0, ignore_eos = 0, print_ids = 0;
    double temperature = 0.0, top_p = 1.0;
    int64_t seed = 0;
    ds_arg opts[] = {
        {"model", "m", DS_ARG_STRING, &model_dir, "DIR", "checkpoint folder", .required = 1},
        {"prompt", "p", DS_ARG_STRING, &prompt, "TEXT", "prompt text", .required = 1},
        DS_OPT("chat", NULL, DS_ARG_BOOL, &chat, NULL,
               "wrap the prompt as a user message in the model's chat format"),
        DS_OPT("max-tokens", "n", DS_ARG_INT, &max_tokens, "N", "tokens to generate"),
        DS_OPT("temperature", "t", DS_ARG_FLOAT, &temperature, "T", "0 = greedy"),
        DS_OPT("top-p", NULL, DS_ARG_FLOAT, &top_p, "P", "nucleus sampling mass (1 = off)"),
        DS_OPT("top-k", NULL, DS_ARG_INT, &top_k, "K", "keep the K most likely tokens (0 = off)"),
        DS_OPT("seed", NULL, DS_ARG_I64, &seed, "S", "sampling seed"),
        DS_OPT("ignore-eos", NULL, DS_ARG_BOOL, &ignore_eos, NULL, "do not stop at end of turn"),
        DS_OPT("print-ids", NULL, DS_ARG_BOOL, &print_ids, NULL,
               "after the text, the generated token ids on a line of their own (special and "
               "unprintable tokens included)"),
        {"device", NULL, DS_ARG_STRING, &device, "D", "cpu, cuda or auto",
         .choices = ds_device_names},
    };
    ds_args a = {"deltaserve generate",
                 "Stream a completion of one prompt to stdout, then print prompt and decode speed\n"
                 "and the memory bandwidth decode achieved.",
                 opts, (int)DS_ARRAY_LEN(opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    if (max_tokens < 0 || temperature < 0 || top_p <= 0 || top_p > 1) {
        fprintf(stderr, "generate: need --max-tokens >= 0, --temperature >= 0, 0 < --top-p <= 1\n");
        return 2;
    }
    ds_err err = {{0}};
    ds_model *m = NULL;
    ds_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    float *logits = NULL, *probs = NULL;
    int32_t *idx = NULL, *out_ids = NULL;
    one_seq s = {0};
    int n = 0, status = 1;
    ds_model_opts mo;
    ds_model_opts_default(&mo);
    mo.device = ds_device_from_name(device);
    if (ds_model_load(model_dir, &mo, &m, &err) || ds_tok_load(model_dir, &tok, &err)) goto done;
    const ds_config *c = ds_model_config(m);
    if (chat) {
        ds_chat_format fmt;
        if (ds_chat_format_from_dir(model_dir, &fmt, &err)) goto done;
        json_t *msgs = json_pack("[{s:s, s:s}]", "role", "user", "content", prompt);
        char *mj = msgs ? json_dumps(msgs, JSON_COMPACT) : NULL;
        json_decref(msgs);
        if (!mj) {
            ds_errf(&err, "generate: could not build the chat message");
            goto done;
        }
        int r = ds_chat_render(tok, fmt, mj, NULL, NULL, &ids, &n, &err);
        free(mj);
        if (r) goto done;
    } else if (ds_tok_encode(tok, prompt, strlen(prompt), 0, &ids, &n, &err)) {
        goto done;
    }
    if (n == 0) {
        ds_errf(&err, "generate: the prompt is empty");
        goto done;
    }
    int V = c->vocab_size;
    logits = ds_malloc((size_t)V * sizeof(float), &err);
    probs = ds_malloc((size_t)V * sizeof(float), &err);
    idx = ds_malloc((size_t)V * sizeof(int32_t), &err);
    out_ids = ds_malloc((size_t)(max_tokens + 1) * sizeof(int32_t), &err);
    if (!logits || !probs || !idx || !out_ids || one_seq_init(&s, m, n + max_tokens + 1, &err))
        goto done;
    ds_sample_params sp;
    ds_sample_params_default(&sp);
    sp.temperature = (float)temperature;
    sp.top_p = (float)top_p;
    sp.top_k = top_k;
    ds_rng rng;
    ds_rng_seed(&rng, (uint64_t)seed);
    int32_t stop = c->eos_token_id; /* the end-of-turn id of config.json, not [EOS] */
    double t0 = ds_now();
    if (feed(m, &s, ids, n, 0, logits, &err)) goto done;
    double t_prompt = ds_now() - t0;
    int produced = 0;
    double t1 = ds_now();
    while (produced < max_tokens) {
        int32_t next = ds_sample(logits, V, &sp, &rng, probs, idx);
        out_ids[produced++] = next;
        if (next == stop && !ignore_eos) break;
        size_t blen;
        const char *bytes = ds_tok_token_bytes(tok, next, &blen);
        if (bytes && !ds_tok_is_special(tok, next)) {
            fwrite(bytes, 1, blen, stdout);
            fflush(stdout);
        }
        if (produced == max_tokens) break;
        if (feed(m, &s, &next, 1, n + produced - 1, logits, &err)) goto done;
    }
    double t_decode = ds_now() - t1;
    /* The first sampled token came from the prompt's logits; decode steps = produced - 1. */
    int steps = produced > 1 ? produced - 1 : 0;
    /* each step's reads: the weights, the state and vectors at the prompt's context (its fewest) */
    double step_bytes = ds_model_decode_bytes(m) + ds_model_decode_state_bytes(m, n);
    double gbs = steps ? step_bytes * steps / t_decode / 1e9 : 0;
    fprintf(stdout, "\n");
    if (print_ids) {
        for (int i = 0; i < produced; i++) fprintf(stdout, "%s%d", i ? "," : "ids: ", out_ids[i]);
        fprintf(stdout, "\n");
    }
    fprintf(stderr,
            "[deltaserve] prompt %d tokens, %.1f tok/s | decode %d tokens, %.1f tok/s | "
            "%.2f GB/s read on %s\n",
            n, n / t_prompt, steps, steps ? steps / t_decode : 0.0, gbs, ds_model_device_name(m));
    status = 0;
done:
    if (status) fprintf(stderr, "generate: %s\n", err.msg);
    one_seq_free(&s);
    free(ids);
    free(logits);
    free(probs);
    free(idx);
    free(out_ids);
    ds_tok_free(tok);
    ds_model_free(m);
    return status;
}

/* Parses "1,2,3" into ids (malloc'd). */
static int parse_ids(const char *s, int32_t **ids, int *n, ds_err *err) {
    int cap = 16, len = 0;
    int32_t *v = ds_malloc((size_t)cap * sizeof *v, err);
    if (!v) return DS_ERR;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX || (*end && *end != ',')) {
            free(v);
            return ds_errf(err,
                           "--token-ids: expected comma-separated non-negative integers, "
                           "bad entry at '%.20s'",
                           p);
        }
        if (len == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, (size_t)cap * sizeof *v);
            if (!nv) {
                free(v);
                return ds_errf(err, "out of memory");
            }
            v = nv;
        }
        v[len++] = (int32_t)x;
        p = *end ? end + 1 : end;
    }
    if (!len) {
        free(v);
        return ds_errf(err, "--token-ids: no ids given");
    }
    *ids = v;
    *n = len;
    return DS_OK;
}

/* Writes a little-endian float32 .npy (format 1.0) of shape [rows][cols]. */
static int write_npy(const char *path, const float *data, int rows, int cols, ds_err *err) {
    char header[128];
    int len = snprintf(header, sizeof header,
                       "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }", rows, cols);
    int total = 10 + len + 1;
    int pad = (64 - total % 64) % 64; /* header block aligned to 64 bytes */
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) return ds_errf(err, "%s: cannot create: %s", tmp, strerror(errno));
    unsigned short hlen = (unsigned short)(len + pad + 1);
    unsigned char magic[10] = {0x93,
                               'N',
                               'U',
                               'M',
                               'P',
                               'Y',
                               1,
                               0,
                               (unsigned char)(hlen & 0xff),
                               (unsigned char)(hlen >> 8)};
    int ok = fwrite(magic, 1, 10, f) == 10 && fwrite(header, 1, (size_t)len, f) == (size_t)len;
    for (int i = 0; i < pad && ok; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    ok = ok && fwrite(data, sizeof(float), (size_t)rows * cols, f) == (size_t)rows * cols;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path)) {
        remove(tmp);
        return ds_errf(err, "%s: write failed: %s", path, strerror(errno));
    }
    return DS_OK;
}

int ds_cmd_logits(int argc, char **argv) {
    const char *model_dir = NULL, *ids_arg = NULL, *out = NULL, *partition = "";
    const char *device = default_device();
    int tp = 1, pp = 1;
    ds_arg opts[] = {
        {"model", "m", DS_ARG_STRING, &model_dir, "DIR", "checkpoint folder", .required = 1},
        {"token-ids", NULL, DS_ARG_STRING, &ids_arg, "1,2,3", "input token ids", .required = 1},
        {"out", "o", DS_ARG_STRING, &out, "FILE.npy", "where to write the logits", .required = 1},
        DS_OPT("tensor-parallel-size", "tp", DS_ARG_INT, &tp, "T", "tensor-parallel ranks"),
        DS_OPT("pipeline-parallel-size", "pp", DS_ARG_INT, &pp, "P", "pipeline stages"),
        DS_OPT("pp-layer-partition", NULL, DS_ARG_STRING, &partition, "2,3,3,2",
               "layers per stage (default: even, remainder to the middle stages)"),
        {"device", NULL, DS_ARG_STRING, &device, "D",
         "cpu, cuda (rank r of a host uses GPU r mod count) or auto", .choices = ds_device_names},
    };
    ds_args a = {"deltaserve logits",
                 "Teacher-forced logits of every position, written as a float32 .npy array of\n"
                 "shape [T, vocab]. With -tp/-pp it runs on T x P ranks under MPI (re-launching\n"
                 "itself through mpirun unless started by it); the last stage writes the file.",
                 opts, (int)DS_ARRAY_LEN(opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    ds_err err = {{0}};
    int32_t *ids = NULL;
    int n = 0, status = 1;
    float *logits = NULL;
    one_seq s = {0};
    ds_rank r = {0};
    ds_pp_bufs io = {0};
    int counts[DS_MAX_LAYERS];
    if (parse_ids(ids_arg, &ids, &n, &err)) {
        if (!ds_rank_quiet()) fprintf(stderr, "logits: %s\n", err.msg);
        free(ids);
        return 2;
    }
    if ((rc = ds_rank_prepare("logits", model_dir, tp, pp, partition, counts, argc, argv)) >= 0) {
        free(ids);
        return rc;
    }
    ds_model_opts o;
    ds_model_opts_default(&o);
    o.device = ds_device_from_name(device);
    if (ds_rank_open(model_dir, tp, pp, counts, &o, &r, &err)) goto done;
    int V = ds_model_config(r.m)->vocab_size;
    if (r.last) logits = ds_malloc((size_t)n * V * sizeof(float), &err);
    if ((r.last && !logits) || one_seq_init(&s, r.m, n, &err)) goto done;
    ds_seq_batch sb = {ids,  n, 0,    s.slot, s.table, logits, r.last ? n : 0, NULL, NULL,
                       NULL, 0, NULL, NULL,   NULL,    NULL};
    if (ds_pp_step(r.comm, r.m, &s.pool, &sb, 1, &io, &err)) goto done;
    /* Every TP rank of the last stage holds the same logits (replicated lm_head); one writes. */
    if (r.last && r.comm->tp_rank == 0 && write_npy(out, logits, n, V, &err)) goto done;
    status = 0;
done:
    if (status) {
        /* In a job, say which rank failed, unless the comm's message already does. */
        int named =
            !r.comm || r.comm->size == 1 || !strncmp(err.msg, r.comm->who, strlen(r.comm->who));
        fprintf(stderr, "logits: %s%s%s\n", named ? "" : r.comm->who, named ? "" : ": ", err.msg);
    }
    ds_pp_bufs_free(&io);
    one_seq_free(&s);
    free(ids);
    free(logits);
    ds_model_free(r.m);
    return ds_comm_finish(r.comm, status);
}
