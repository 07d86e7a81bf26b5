/* engine_flags.h — the flags of the commands that run the engine (serve, generate): which model,
 * where it runs (device, TP x PP), how much cache it gets, speculative decoding, and the hidden
 * test hooks. Their defaults are ds_engine_opts_default's, so a default lives in one place (the
 * library), and a wrong value's error names its flag. A command adds its own flags to the same
 * table:
 *     ds_engine_flags f;
 *     if (ds_engine_flags_init(&f, "serve")) return 2;
 *     ds_arg opts[DS_ENGINE_FLAGS_MAX + 8];
 *     int n = ds_engine_flags_table(&f, opts);
 *     opts[n++] = (ds_arg)DS_OPT("port", ...);
 *     ... ds_args_parse_cli ..., then ds_engine_flags_apply(&f, &a, &err) fills f.eo. */
#ifndef DS_CLI_ENGINE_FLAGS_H
#define DS_CLI_ENGINE_FLAGS_H

#include "cli/args.h"
#include "cli/test_hooks.h"
#include "engine/engine.h"
#include "model/model.h"

enum { DS_ENGINE_FLAGS_MAX = 19 + DS_TEST_FLAGS_MAX }; /* entries ds_engine_flags_table writes */

typedef struct ds_engine_flags {
    ds_engine_opts eo; /* the defaults; ds_engine_flags_apply writes the flags into it */
    const char *cmd;   /* "serve": prefixes messages */
    const char *device, *kv_mem, *kv_dtype, *spec_method, *relay, *partition, *quant, *load_format;
    const char *kv_transfer; /* --kv-transfer-config JSON (docs/pd.md) */
    char *kv_ip;             /* its kv_ip, owned (eo.kv_ip points here) */
    int tp, pp;
    int counts[DS_MAX_LAYERS]; /* [pp] layers per stage, from ds_engine_flags_job */
    ds_test_flags test;
} ds_engine_flags;

/* Defaults from ds_engine_opts_default. DS_ERR (after saying so on stderr) when DS_DEVICE names
 * no device. */
int ds_engine_flags_init(ds_engine_flags *f, const char *cmd);

/* Writes the flags' entries into out[DS_ENGINE_FLAGS_MAX]; returns how many. */
int ds_engine_flags_table(ds_engine_flags *f, ds_arg *out);

/* After parsing a (the table that holds f's entries): checks the values and fills f->eo. Errors
 * name the flag, e.g. --num-speculative-tokens without --speculative-method. */
int ds_engine_flags_apply(ds_engine_flags *f, const ds_args *a, ds_err *err);

/* Starts the TP x PP job: checks the layer split (a usage error is said once: returns 2), runs the
 * command again under mpirun for more than one rank (returns the job's status; supervised: as a
 * child that SIGINT/SIGTERM stop in order, see transport/launch.h), else joins the job and puts
 * its comm into f->eo. -1: go on as a rank of the job (or alone). */
int ds_engine_flags_job(ds_engine_flags *f, int supervised, int argc, char **argv);

/* A rank other than the head: no I/O, just the engine in lock step with the head until the
 * head's stop reaches it. Returns the process's exit status (ds_comm_finish's). */
int ds_engine_flags_run_rank(ds_engine_flags *f);

void ds_engine_flags_free(ds_engine_flags *f); /* the test hooks' state; after the engine */

/* --kv-transfer-config: vLLM's KVTransferConfig JSON, {"kv_role": "kv_producer" | "kv_consumer" |
 * "kv_both", "kv_connector"?, "kv_ip"?, "kv_port"?, "kv_connector_extra_config"?:
 * {"hold_timeout_s", "pull_timeout_s"}} (vLLM's other fields are accepted and unused) into eo; *ip
 * gets kv_ip (malloc'd). Errors name the field. */
int ds_parse_kv_transfer_config(const char *json, ds_engine_opts *eo, char **ip, ds_err *err);

/* "2G", "512M", "1.5GiB", "1073741824" -> bytes. Suffixes K, M, G, T are powers of 1024, with an
 * optional "i" and "B"/"b". */
int ds_parse_bytes(const char *s, size_t *out, ds_err *err);

#endif
