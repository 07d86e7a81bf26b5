/* offload.h — the KV / state offload tier: pages (the latent rows of every MLA layer of one page)
 * and KDA checkpoints that leave the device pools are kept in host RAM, on local disk and in a
 * remote Redis, and loaded back on a prefix hit the device pools no longer hold.
 *
 * An entry is addressed by (model id, layer range, TP rank, layout version, kind, prefix hash) and
 * carries the token ids of the whole prefix it summarises, so a load is confirmed by comparing
 * them, never by hash alone, and a checksum (XXH3-64) over the entry, so a damaged entry is a
 * counted miss. Each tier is optional; every call is safe with none configured. Remote failures
 * (timeouts of remote_timeout_ms, a server gone away) cost misses only: after one the remote is
 * left alone for a second and then reconnected lazily. */
#ifndef DS_OFFLOAD_H
#define DS_OFFLOAD_H

#include "base/ds_base.h"

typedef struct ds_offload ds_offload;

typedef struct ds_offload_opts {
    size_t ram_bytes;       /* host-RAM tier budget; 0: no RAM tier */
    const char *disk_dir;   /* local-disk tier folder (created if missing); NULL: none */
    size_t disk_bytes;      /* budget for files this process wrote; 0: unlimited */
    const char *remote;     /* "redis://host:port"; NULL: none */
    int remote_timeout_ms;  /* connect and command timeout (default 100 when 0) */
    const char *model_id;   /* [A-Za-z0-9_.-], identifies model weights and config */
    int layer_lo, layer_hi; /* layers of this stage [lo, hi) */
    int tp_rank;
    int layout; /* bump when the page or slot layout changes */
} ds_offload_opts;

typedef struct ds_offload_stats {
    uint64_t stores; /* entries handed to the tiers (one per put) */
    uint64_t loads_ram, loads_disk, loads_remote;
    uint64_t misses;        /* gets no tier could answer (bad entries included) */
    uint64_t bad;           /* entries that failed the checksum, header or token check */
    uint64_t remote_errors; /* connects or commands that failed or timed out */
} ds_offload_stats;

int ds_offload_create(const ds_offload_opts *o, ds_offload **out, ds_err *err);
void ds_offload_free(ds_offload *o);
/* 1 when at least one tier is configured. */
int ds_offload_enabled(const ds_offload *o);

/* kind: 'p' a page, 'c' a KDA checkpoint. hash: the 128-bit prefix hash; tokens[0..n_tokens):
 * the prefix it summarises; data: the payload, n_floats 4-byte words of opaque bytes (a page's
 * latent rows may be f32 or FP8). Stores into every tier. */
void ds_offload_put(ds_offload *o, char kind, const uint64_t hash[2], const int32_t *tokens,
                    int n_tokens, const void *data, size_t n_floats);
/* Looks the entry up in RAM, then disk, then remote (promoting a lower-tier hit to RAM). Returns
 * 1 and fills out[0..n_floats) on a confirmed hit, 0 on a miss (out may then be clobbered). */
int ds_offload_get(ds_offload *o, char kind, const uint64_t hash[2], const int32_t *tokens,
                   int n_tokens, void *out, size_t n_floats);
void ds_offload_get_stats(const ds_offload *o, ds_offload_stats *s);

#endif
