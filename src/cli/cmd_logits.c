/* cmd_logits.c — `deltaserve logits`: the teacher-forced logits of a token sequence, written as
 * .npy. It runs one sequence directly on the model (no engine: every position's logits are
 * wanted, which the engine never keeps), with its own state slot and a private latent pool sized
 * for the request, on one rank or on the T x P ranks of a -tp/-pp job. */
#include "base/devmem.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/ranks.h"
#include "model/model.h"
#include "parallel/pipeline.h"
#include "transport/comm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LOGITS_BLOCK = 64 };

/* A single sequence's cache: one KDA slot and a latent pool of just enough pages. */
typedef struct one_seq {
    ds_kv_pool pool;
    int32_t *table;    /* [n_pages] identity block table */
    float *slot;       /* [ds_model_slot_floats], in dm's memory */
    const ds_dmem *dm; /* the model's memory (NULL: the host's) */
} one_seq;

static int one_seq_init(one_seq *s, const ds_model *m, int max_ctx, ds_err *err) {
    memset(s, 0, sizeof *s);
    int n_pages = (max_ctx + LOGITS_BLOCK - 1) / LOGITS_BLOCK;
    if (ds_kv_pool_init(&s->pool, m, n_pages, LOGITS_BLOCK, err)) return DS_ERR;
    s->table = ds_malloc((size_t)n_pages * sizeof(int32_t), err);
    size_t bytes = ds_model_slot_floats(m) * sizeof(float);
    s->dm = ds_model_dmem(m);
    s->slot = ds_dmem_alloc(s->dm, bytes, err);
    if (!s->table || !s->slot) return DS_ERR;
    ds_dmem_zero(s->dm, s->slot, bytes); /* a new sequence starts from the zero state */
    for (int i = 0; i < n_pages; i++) s->table[i] = i;
    return DS_OK;
}

static void one_seq_free(one_seq *s) {
    ds_kv_pool_free(&s->pool);
    free(s->table);
    ds_dmem_free(s->dm, s->slot);
}

/* --device's default: cpu, or DS_DEVICE (an unknown name there is taken for cpu: the flag, or
 * serve, names it). */
static const char *default_device(void) {
    ds_model_opts o;
    ds_model_opts_default(&o);
    return ds_device_names[o.device < 0 ? DS_DEVICE_CPU : o.device];
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
    const char *device = default_device(), *quant = "none", *quant_exclude = NULL;
    const char *kv_dtype = "auto";
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
        {"quantization", "q", DS_ARG_STRING, &quant, "Q",
         "weights: none or ptpc_fp8 (see serve --help)", .choices = ds_quant_names},
        DS_OPT("quantization-exclude", NULL, DS_ARG_STRING, &quant_exclude, "A,B,..",
               "ptpc_fp8: name fragments kept unquantized (see serve --help)"),
        {"kv-cache-dtype", NULL, DS_ARG_STRING, &kv_dtype, "T",
         "MLA latent cache: auto (f32 rows), fp8 or bf16 (see serve --help)",
         .choices = ds_kv_dtype_names},
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
    o.quantization = ds_quant_from_name(quant);
    o.quantization_exclude = quant_exclude;
    o.kv_dtype = ds_kv_dtype_from_name(kv_dtype);
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
