/* engine_flags.c — see engine_flags.h. */
#include "cli/engine_flags.h"

#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/ranks.h"
#include "parallel/pipeline.h"
#include "transport/comm.h"
#include "transport/launch.h"

static const char *const SPEC_METHODS[] = {"none", "dspark", "ngram", NULL};
static const char *const LOAD_FORMATS[] = {"safetensors", "dummy", "random", NULL};
static const char *const RELAYS[] = {"partial-sum", "plain", NULL};

int ds_parse_bytes(const char *s, size_t *out, ds_err *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || v < 0) return ds_errf(err, "expected a size such as 2G, got '%s'", s);
    double mult = 1;
    switch (*end) {
    case 'k':
    case 'K':
        mult = 1024.0, end++;
        break;
    case 'm':
    case 'M':
        mult = 1024.0 * 1024, end++;
        break;
    case 'g':
    case 'G':
        mult = 1024.0 * 1024 * 1024, end++;
        break;
    case 't':
    case 'T':
        mult = 1024.0 * 1024 * 1024 * 1024, end++;
        break;
    default:
        break;
    }
    if (mult > 1 && *end == 'i') end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end) return ds_errf(err, "expected a size such as 2G, got '%s'", s);
    if (v * mult > (double)SIZE_MAX / 2) return ds_errf(err, "size '%s' is too large", s);
    *out = (size_t)(v * mult);
    return DS_OK;
}

int ds_engine_flags_init(ds_engine_flags *f, const char *cmd) {
    memset(f, 0, sizeof *f);
    ds_engine_opts_default(&f->eo);
    f->cmd = cmd;
    if (f->eo.device < 0) {
        fprintf(stderr, "%s: DS_DEVICE=%s: expected cpu, cuda or auto\n", cmd, getenv("DS_DEVICE"));
        return DS_ERR;
    }
    f->device = ds_device_names[f->eo.device];
    f->spec_method = SPEC_METHODS[f->eo.speculative_method];
    f->relay = RELAYS[f->eo.draft_tap_relay];
    f->kv_dtype = ds_kv_dtype_names[0];
    f->partition = "";
    f->quant = ds_quant_names[f->eo.quantization];
    f->load_format = LOAD_FORMATS[0];
    f->tp = f->pp = 1;
    return DS_OK;
}

int ds_engine_flags_table(ds_engine_flags *f, ds_arg *out) {
    ds_engine_opts *eo = &f->eo;
    ds_arg table[] = {
        {"model", "m", DS_ARG_STRING, &eo->model_dir, "DIR", "checkpoint folder", .required = 1},
        {"load-format", NULL, DS_ARG_STRING, &f->load_format, "F",
         "safetensors (the checkpoint's weights), or dummy / random: weights drawn for "
         "config.json's shape, no weight files read (benchmarks; `init-model --shape-of` writes "
         "such a folder)",
         .choices = LOAD_FORMATS},
        {"device", NULL, DS_ARG_STRING, &f->device, "D",
         "cpu, cuda (weights and caches in GPU memory; under MPI the rank with local rank r uses "
         "GPU r mod count) or "
         "auto (cuda when built with it and a GPU is present)",
         .choices = ds_device_names},
        DS_OPT("batch-invariant", NULL, DS_ARG_BOOL, &eo->batch_invariant, NULL,
               "CUDA: every matmul streams the weights with f32 activations, so a request's output "
               "never depends on its batch (the CPU always is); slower prefill"),
        DS_OPT("enforce-eager", NULL, DS_ARG_BOOL, &eo->enforce_eager, NULL,
               "CUDA: no CUDA graphs (by default each decode / verify shape is captured once and "
               "replayed, also under -pp)"),
        {"quantization", "q", DS_ARG_STRING, &f->quant, "Q",
         "weights: none (as the checkpoint has them) or ptpc_fp8 (BF16 Linears to FP8 with a "
         "scale per output channel and per token, docs/quantization.md)",
         .choices = ds_quant_names},
        DS_OPT("quantization-exclude", NULL, DS_ARG_STRING, &eo->quantization_exclude, "A,B,..",
               "ptpc_fp8: weights whose name contains one of these stay unquantized (replaces "
               "the default list: embed_tokens,lm_head,conv1d,block_sparse_moe.gate.weight,"
               "self_attn.b_proj,kv_b_proj)"),
        DS_OPT("kv-cache-memory", NULL, DS_ARG_STRING, &f->kv_mem, "BYTES",
               "memory for MLA pages + KDA state slots, e.g. 2G (default: a fraction of free)"),
        {"kv-cache-dtype", NULL, DS_ARG_STRING, &f->kv_dtype, "T",
         "MLA latent cache: auto (f32 rows), fp8 (E4M3 with a scale per 128 values, BF16 rope "
         "part: 656 bytes a row at K3's shape) or bf16 (1,152 bytes; docs/quantization.md)",
         .choices = ds_kv_dtype_names},
        DS_OPT("kv-cache-fraction", NULL, DS_ARG_FLOAT, &eo->kv_cache_fraction, "F",
               "fraction of free memory for the caches when --kv-cache-memory is not given"),
        DS_OPT("max-model-len", NULL, DS_ARG_INT, &eo->max_model_len, "N",
               "context limit (0: the model's, capped by the cache)"),
        {"speculative-method", "method", DS_ARG_STRING, &f->spec_method, "M",
         "speculative decoding: dspark (draft model) or ngram (prompt lookup)",
         .choices = SPEC_METHODS},
        DS_OPT("num-speculative-tokens", NULL, DS_ARG_INT, &eo->num_speculative_tokens, "K",
               "drafts verified per step (needs --speculative-method)"),
        DS_OPT("draft-model", NULL, DS_ARG_STRING, &eo->draft_model_dir, "DIR",
               "DSpark draft checkpoint (default: MODEL/draft)"),
        {"draft-tap-relay", NULL, DS_ARG_STRING, &f->relay, "R",
         "DSpark under -pp: partial-sum (one [tokens, hidden] sum per stage boundary) or plain "
         "(every tap sent to the last stage)",
         .choices = RELAYS},
        DS_OPT("tensor-parallel-size", "tp", DS_ARG_INT, &f->tp, "T",
               "tensor-parallel ranks per stage (MPI; re-launches through mpirun)"),
        DS_OPT("pipeline-parallel-size", "pp", DS_ARG_INT, &f->pp, "P", "pipeline stages"),
        DS_OPT("pp-layer-partition", NULL, DS_ARG_STRING, &f->partition, "N,N,...",
               "layers per stage (default: even, remainder to the middle stages)"),
        DS_OPT("kv-transfer-config", NULL, DS_ARG_STRING, &f->kv_transfer, "JSON",
               "prefill/decode disaggregation, vLLM's form: {\"kv_role\": \"kv_producer\" | "
               "\"kv_consumer\" | \"kv_both\", \"kv_ip\", \"kv_port\"} (docs/pd.md)"),
    };
    _Static_assert(DS_ARRAY_LEN(table) + DS_TEST_FLAGS_MAX == DS_ENGINE_FLAGS_MAX,
                   "DS_ENGINE_FLAGS_MAX counts the table");
    memcpy(out, table, sizeof table);
    return (int)DS_ARRAY_LEN(table) + ds_test_flags_table(&f->test, out + DS_ARRAY_LEN(table));
}

static int index_of(const char *const *names, const char *s) {
    for (int i = 0; names[i]; i++)
        if (strcmp(names[i], s) == 0) return i;
    return 0;
}

int ds_engine_flags_apply(ds_engine_flags *f, const ds_args *a, ds_err *err) {
    ds_engine_opts *eo = &f->eo;
    if (f->kv_mem && ds_parse_bytes(f->kv_mem, &eo->kv_cache_memory, err))
        return ds_err_prefix(err, "--kv-cache-memory");
    if (eo->kv_cache_fraction <= 0 || eo->kv_cache_fraction > 1)
        return ds_errf(err, "--kv-cache-fraction: expected 0 < F <= 1, got %g",
                       eo->kv_cache_fraction);
    if (eo->max_model_len < 0)
        return ds_errf(err, "--max-model-len: expected N >= 0, got %d", eo->max_model_len);
    if (f->tp < 1 || f->pp < 1)
        return ds_errf(err, "%s: expected at least 1, got %d",
                       f->tp < 1 ? "--tensor-parallel-size" : "--pipeline-parallel-size",
                       f->tp < 1 ? f->tp : f->pp);
    eo->device = ds_device_from_name(f->device);
    eo->quantization = ds_quant_from_name(f->quant);
    if (eo->quantization_exclude && eo->quantization != DS_QUANT_PTPC_FP8)
        return ds_errf(err, "--quantization-exclude needs --quantization ptpc_fp8");
    eo->speculative_method = index_of(SPEC_METHODS, f->spec_method);
    eo->draft_tap_relay = index_of(RELAYS, f->relay);
    eo->kv_dtype = ds_kv_dtype_from_name(f->kv_dtype);
    eo->load_random = strcmp(f->load_format, "safetensors") != 0;
    if (ds_args_seen(a, "num-speculative-tokens") && eo->speculative_method == DS_SPEC_NONE)
        return ds_errf(err,
                       "--num-speculative-tokens needs --speculative-method (dspark or ngram)");
    if (eo->num_speculative_tokens < 1 || eo->num_speculative_tokens > DS_MAX_SPEC)
        return ds_errf(err, "--num-speculative-tokens: expected 1..%d, got %d", DS_MAX_SPEC,
                       eo->num_speculative_tokens);
    if (f->kv_transfer && ds_parse_kv_transfer_config(f->kv_transfer, eo, &f->kv_ip, err))
        return ds_err_prefix(err, "--kv-transfer-config");
    return ds_test_flags_apply(&f->test, eo, err);
}

static const char *const KV_ROLES[] = {"", "kv_producer", "kv_consumer", "kv_both", NULL};
/* vLLM KVTransferConfig fields accepted without a use here */
static const char *const KV_IGNORED[] = {"kv_buffer_size",
                                         "kv_buffer_device",
                                         "kv_rank",
                                         "kv_parallel_size",
                                         "engine_id",
                                         "kv_load_failure_policy",
                                         "kv_connector_module_path",
                                         NULL};

static int kv_seconds(json_t *extra, const char *key, int *ms, ds_err *err) {
    json_t *v = json_object_get(extra, key);
    if (!v) return DS_OK;
    if (!json_is_number(v) || json_number_value(v) <= 0 || json_number_value(v) > 86400)
        return ds_errf(err, "kv_connector_extra_config.%s: expected seconds in (0, 86400]", key);
    *ms = (int)(json_number_value(v) * 1000);
    return DS_OK;
}

static int kv_known(const char *key) {
    static const char *const USED[] = {
        "kv_role", "kv_connector", "kv_ip", "kv_port", "kv_connector_extra_config", NULL};
    for (int i = 0; USED[i]; i++)
        if (!strcmp(USED[i], key)) return 1;
    for (int i = 0; KV_IGNORED[i]; i++)
        if (!strcmp(KV_IGNORED[i], key)) return 1;
    return 0;
}

static int kv_fields(json_t *root, ds_engine_opts *eo, char **ip, ds_err *err) {
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) if (!kv_known(key)) return ds_errf(
        err,
        "unknown field '%s' (expected kv_role, kv_connector, kv_ip, kv_port, "
        "kv_connector_extra_config)",
        key);
    json_t *role = json_object_get(root, "kv_role");
    if (!json_is_string(role))
        return ds_errf(err,
                       "kv_role: expected \"kv_producer\", \"kv_consumer\" or "
                       "\"kv_both\"%s",
                       role ? "" : " (missing)");
    eo->kv_role = 0;
    for (int i = 1; KV_ROLES[i]; i++)
        if (!strcmp(KV_ROLES[i], json_string_value(role))) eo->kv_role = i;
    if (!eo->kv_role)
        return ds_errf(err, "kv_role: expected kv_producer, kv_consumer or kv_both, got '%s'",
                       json_string_value(role));
    v = json_object_get(root, "kv_connector");
    if (v && !json_is_string(v)) return ds_errf(err, "kv_connector: expected a string");
    v = json_object_get(root, "kv_ip");
    if (v && !json_is_string(v)) return ds_errf(err, "kv_ip: expected a string");
    if (v && !(*ip = strdup(json_string_value(v)))) return ds_errf(err, "out of memory");
    eo->kv_ip = *ip;
    v = json_object_get(root, "kv_port");
    if (v && (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 65535))
        return ds_errf(err, "kv_port: expected an integer in 0..65535");
    if (v) eo->kv_port = (int)json_integer_value(v);
    json_t *extra = json_object_get(root, "kv_connector_extra_config");
    if (extra && !json_is_object(extra))
        return ds_errf(err, "kv_connector_extra_config: expected an object");
    if (extra && (kv_seconds(extra, "hold_timeout_s", &eo->kv_hold_timeout_ms, err) ||
                  kv_seconds(extra, "pull_timeout_s", &eo->kv_pull_timeout_ms, err)))
        return DS_ERR;
    return DS_OK;
}

int ds_parse_kv_transfer_config(const char *json, ds_engine_opts *eo, char **ip, ds_err *err) {
    json_error_t je;
    json_t *root = json_loads(json, 0, &je);
    if (!root) return ds_errf(err, "not valid JSON: %s (at column %d)", je.text, je.column);
    int rc = json_is_object(root) ? kv_fields(root, eo, ip, err)
                                  : ds_errf(err, "expected a JSON object such as "
                                                 "{\"kv_role\": \"kv_producer\"}");
    json_decref(root);
    return rc;
}

int ds_engine_flags_job(ds_engine_flags *f, int supervised, int argc, char **argv) {
    ds_err err = {{0}};
    const int n = f->tp * f->pp;
    if (!supervised || n == 1 || ds_comm_under_mpirun()) {
        int rc = ds_rank_prepare(f->cmd, f->eo.model_dir, f->tp, f->pp, f->partition, f->counts,
                                 argc, argv);
        if (rc >= 0) return rc;
    } else { /* a long-running job: mpirun as a child that hands signals on */
        if (ds_pp_check_split(f->eo.model_dir, f->tp, f->pp, f->partition, f->counts, &err)) {
            fprintf(stderr, "%s: %s\n", f->cmd, err.msg);
            return 2;
        }
        int st = 1;
        if (ds_launch_mpirun_supervised(n, argc, argv, &st, &err)) {
            fprintf(stderr, "%s: %s\n", f->cmd, err.msg);
            return 1;
        }
        return st;
    }
    /* A rank that hangs must end the job: ranks wait at most this long for each other (an idle
     * head still sends a plan every second). */
    if (n > 1 && !getenv("DS_COMM_TIMEOUT_S")) setenv("DS_COMM_TIMEOUT_S", "60", 1);
    ds_comm *comm = NULL;
    if (ds_comm_init(f->tp, f->pp, &comm, &err)) {
        fprintf(stderr, "%s: %s\n", f->cmd, err.msg);
        return ds_comm_finish(comm, 1);
    }
    f->eo.comm = comm;
    f->eo.pp_layer_counts = f->counts;
    return -1;
}

int ds_engine_flags_run_rank(ds_engine_flags *f) {
    /* Signals are the head's business (mpirun forwards them to every rank). */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGUSR1, SIG_IGN);
    ds_comm *comm = f->eo.comm;
    ds_err err = {{0}};
    ds_engine *e = NULL;
    int status = 0;
    if (ds_engine_create(&f->eo, &e, &err) || ds_engine_start(e, &err)) {
        fprintf(stderr, "%s: %s: %s\n", f->cmd, comm->who, err.msg);
        status = 1;
    } else {
        ds_engine_join(e);
    }
    ds_engine_free(e);
    ds_engine_flags_free(f);
    return ds_comm_finish(comm, status);
}

void ds_engine_flags_free(ds_engine_flags *f) {
    ds_test_flags_free(&f->test);
    free(f->kv_ip);
    f->kv_ip = NULL;
}
