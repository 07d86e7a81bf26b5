/* test_hooks.h — the command line's test-only flags, in one place: what they fill (the engine's
 * ds_test_hooks) and the state behind them. They are hidden from --help (DS_TEST_OPT) and are
 * all off unless given.
 *   --speculative-test-oracle FILE  drafts from known greedy outputs (tests/e2e/test_dist.py)
 *   --prefix-hash-bits N            the prefix cache keeps N hash bits, forcing collisions
 *   --test-kv-corrupt M, --test-kv-stall-ms MS   P/D faults (tests/e2e/test_pd.py)
 *   --test-async-masks 1            grammar masks beside the forward, as on a GPU */
#ifndef DS_CLI_TEST_HOOKS_H
#define DS_CLI_TEST_HOOKS_H

#include "cli/args.h"
#include "engine/engine.h"

enum { DS_TEST_FLAGS_MAX = 5 }; /* entries ds_test_flags_table writes at most */

typedef struct ds_test_oracle ds_test_oracle;

typedef struct ds_test_flags {
    const char *oracle_path; /* --speculative-test-oracle */
    int prefix_hash_bits;    /* --prefix-hash-bits */
    int kv_corrupt;          /* --test-kv-corrupt */
    int kv_stall_ms;         /* --test-kv-stall-ms */
    int async_masks;         /* --test-async-masks */
    ds_test_oracle *oracle;  /* loaded by ds_test_flags_apply; outlives the engine */
} ds_test_flags;

/* Writes the hidden flags' entries into out[DS_TEST_FLAGS_MAX]; returns how many. */
int ds_test_flags_table(ds_test_flags *t, ds_arg *out);

/* After parsing: loads what the flags name and fills eo->test (the oracle also turns speculation
 * on, as ngram, when no method was chosen). Errors name the flag. */
int ds_test_flags_apply(ds_test_flags *t, ds_engine_opts *eo, ds_err *err);

void ds_test_flags_free(ds_test_flags *t);

#endif
