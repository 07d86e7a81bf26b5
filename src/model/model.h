/* model.h — a loaded kimi_linear / Kimi-K3 text model and its forward pass, on the CPU or a GPU
 * (the backend chosen at load: model/backend.h).
 *
 * The forward runs a batch of sequence segments at once: all their tokens go through the
 * projections together (one GEMM per weight), while the token mixers (short conv, KDA recurrence,
 * MLA attention) run per segment against that sequence's own state slot and latent pages.
 *
 * Per-sequence state lives outside the model, so the engine decides where it is kept:
 *   - a KDA state slot (ds_seq_slot): conv tails and recurrent matrices of every KDA layer;
 *   - MLA latent rows in a paged pool (ds_kv_pool), addressed through the sequence's block table.
 * The model never allocates per-sequence memory; it only reads and writes what it is handed. */
#ifndef DS_MODEL_H
#define DS_MODEL_H

#include <stdio.h>

#include "base/devmem.h"
#include "kernels/cpu/kernels.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "sample/sampler.h"

/* Weight quantization methods (ds_model_opts.quantization), and their names (NULL-terminated,
 * indexed by the constant: the --quantization choices). */
enum { DS_QUANT_NONE = 0, DS_QUANT_PTPC_FP8 = 1 };
extern const char *const ds_quant_names[];
/* DS_QUANT_* of a name, -1 for none of them. */
int ds_quant_from_name(const char *name);
/* The latent cache dtypes, NULL-terminated, indexed by DS_KV_* (kernels/shared/kv_row.h): the
 * --kv-cache-dtype choices. "auto" keeps f32 rows. */
extern const char *const ds_kv_dtype_names[];
/* DS_KV_* of a name, -1 for none of them. */
int ds_kv_dtype_from_name(const char *name);
/* The default exclusion list of ptpc_fp8, comma-separated (docs/quantization.md §3). */
extern const char ds_quant_default_exclude[];

/* Where the model runs (issue 9). AUTO: the GPU when this build has the CUDA backend and a device
 * is present, else the CPU. */
enum { DS_DEVICE_CPU = 0, DS_DEVICE_CUDA = 1, DS_DEVICE_AUTO = 2 };
/* Their names, indexed by DS_DEVICE_*, NULL-terminated (the --device choices). */
extern const char *const ds_device_names[];
/* DS_DEVICE_* of a name, -1 for none of them. */
int ds_device_from_name(const char *name);

typedef struct ds_model_opts {
    /* Device: DS_DEVICE_*. The default is the CPU, or DS_DEVICE in the environment (cpu, cuda,
     * auto), which lets the CPU's tests run unchanged on a GPU. On CUDA the weights are uploaded
     * once at load; the latent pool, state slots and verify rows are then device memory
     * (base/devmem.h), while tokens, logits, hidden states and taps stay on the host. */
    int device;
    int device_index; /* which GPU (default 0) */
    /* CUDA only: every matmul uses the weight-streaming kernel with f32 activations, in which a
     * token's result never depends on how many others share its step (cuBLAS picks algorithms by
     * batch size), and which matches the CPU's numbers to ~1e-6. Slower for long prefills. The
     * CPU backend is batch invariant always. Default off, or DS_BATCH_INVARIANT=1. */
    int batch_invariant;
    /* --load-format random: no safetensors are read; every weight the config implies is drawn
     * (BF16 matrices, made directly in GPU memory on CUDA), for benchmarks at full shape. DIR
     * needs only config.json. */
    int load_random;
    uint64_t random_seed;
    /* CUDA: run every step eagerly (no CUDA graphs; --enforce-eager). By default a decode or
     * verify step's launches are captured once per shape and replayed. */
    int enforce_eager;
    int kda_chunk;          /* chunk length of the chunked KDA form (default 64) */
    int kda_chunked_min;    /* segments with at least this many tokens use the chunked form */
    int mla_expanded_min;   /* segments with at least this many tokens use expanded MLA */
    int hf_kl_router_quirk; /* reproduce HF-KL's biased combine weights (parity tests only) */
    /* --quantization (docs/quantization.md §3): DS_QUANT_NONE, or DS_QUANT_PTPC_FP8 (every BF16
     * Linear in scope becomes FP8 E4M3 with a scale per output row at load; activations get a
     * scale per token). The DSpark draft's own weights stay as they are. */
    int quantization;
    /* --quantization-exclude: comma-separated name fragments; a weight whose tensor name contains
     * one stays unquantized. NULL: the default list (ds_quant_default_exclude). Copied at load. */
    const char *quantization_exclude;
    /* --kv-cache-dtype (DS_KV_*, kernels/shared/kv_row.h): the form of the latent pool's rows,
     * f32 (0), FP8 or BF16; every attention reads their values as f32 (docs/quantization.md §4). */
    int kv_dtype;
    int layer_begin, layer_end; /* pipeline stage: layers [begin, end); end 0 = all */
    /* Tensor parallelism (tp_size > 1): this rank holds 1/tp_size of the KDA heads, MLA heads,
     * dense and shared-expert intermediate rows and routed experts (a contiguous block of each,
     * block tp_rank); q/k/v, gate and up projections are split by output rows (column-parallel),
     * o_proj and down projections by input columns (row-parallel), and the partial outputs are
     * summed with `allreduce` (every rank of the TP group must call the forward together).
     * The embedding and lm_head are vocabulary-parallel: rank r holds rows [r vp, (r+1) vp) with
     * vp = ceil(V / T); embedded rows are summed with `allreduce`, logits gathered with
     * `allgather`. Replicated on every rank: norms, AttnRes, the router, the KDA f_a / g_a
     * low-rank inputs, MLA q_a and kv_a (the latent is shared by all heads, so every rank keeps
     * the full latent rows), and the latent MoE down/up projections. */
    int tp_rank, tp_size; /* 0, 1 without tensor parallelism */
    /* buf[n] <- sum over the TP group; returns DS_OK or DS_ERR (the forward then fails) */
    int (*allreduce)(void *ctx, float *buf, size_t n);
    void *allreduce_ctx;
    /* all[T][n] <- every rank's mine[n] in tp_rank order; DS_OK or DS_ERR likewise */
    int (*allgather)(void *ctx, const float *mine, size_t n, float *all);
    void *allgather_ctx;
} ds_model_opts;

void ds_model_opts_default(ds_model_opts *o);

typedef struct ds_model ds_model;

/* Can cfg be split over T tensor-parallel ranks? KDA heads, MLA heads, routed experts and the
 * dense / shared-expert intermediate sizes must divide by T; the message names each that does not.
 */
int ds_model_tp_check(const ds_config *cfg, int T, ds_err *err);

/* Loads DIR (config.json + safetensors). Every tensor's dtype and shape is checked. */
int ds_model_load(const char *dir, const ds_model_opts *opts, ds_model **out, ds_err *err);
void ds_model_free(ds_model *m);
const ds_config *ds_model_config(const ds_model *m);
/* Bytes of weights a decode step of one token reads (embedding row, every dense weight, the
 * active experts' share, lm_head). */
double ds_model_decode_bytes(const ds_model *m);
/* The rest of what that step must read: the f32 vectors (norms, convs, biases), the sequence's
 * KDA state, its MLA latent rows at `context` tokens. Achieved bandwidth counts both. */
double ds_model_decode_state_bytes(const ds_model *m, int context);
/* Multiply-add FLOPs of the weight GEMMs for one token (attention over the context excluded). */
double ds_model_token_flops(const ds_model *m, int with_lm_head);
/* The token embedding and lm_head ([V][D] each) in host memory, shared with the DSpark draft;
 * NULL where this rank has no host copy (a vocabulary slice under TP; random weights drawn only in
 * GPU memory). */
const ds_mat *ds_model_embed(const ds_model *m);
const ds_mat *ds_model_lm_head(const ds_model *m);
/* Total bytes of weight tensors bound by the model. */
size_t ds_model_weight_bytes(const ds_model *m);
/* Does the model run on a GPU? Its state (slots, latent pool, verify rows) is then device memory.
 */
int ds_model_on_device(const ds_model *m);
/* The memory its state lives in (base/devmem.h): the GPU's it runs on, or NULL (the host's). Valid
 * while the model is. */
const ds_dmem *ds_model_dmem(const ds_model *m);
/* Free device memory in bytes (0 on the CPU). */
size_t ds_model_device_mem_free(const ds_model *m);
/* On a GPU: its copy bandwidth (GB/s, read + written) and BF16 GEMM rate (TFLOP/s), measured now.
 */
int ds_model_device_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err);
/* fn(ctx) is called by the backend in every forward that draws rows, after the forward's work
 * is enqueued and before the draws' masks (ds_row_draw.allow) are read: a caller may still be
 * filling them beside the device's work until fn returns (NULL: no call). */
void ds_model_set_draw_wait(ds_model *m, void (*fn)(void *ctx), void *ctx);
/* The backends: calls the draw wait, if any. */
void ds_model_draw_wait(const ds_model *m);
/* With DS_CUDA_PROFILE=1 on the GPU: prints the device time of each op of the eager steps since
 * the last report to f (NULL: prints nothing), and starts over (nothing on the CPU or without the
 * variable). */
void ds_model_profile_report(const ds_model *m, FILE *f, const char *title);
/* With the profile on: the TFLOP/s of the weight GEMMs that cuBLAS ran since the last report,
 * their device ms a step in *ms_per_step (call before the report: it starts over); else 0. */
double ds_model_profile_gemm_tflops(const ds_model *m, double *ms_per_step);
/* "cpu (avx512)" or the GPU's name. */
const char *ds_model_device_name(const ds_model *m);

/* ---- per-sequence state ------------------------------------------------------------------------
 */
/* Floats in one KDA state slot: conv tails [n_kda][3][W-1][P] followed by recurrent states
 * [n_kda][Hk][dk][dv], with Hk and P = Hk*dk this rank's heads under tensor parallelism. A new
 * sequence starts from all zeros. */
size_t ds_model_slot_floats(const ds_model *m);
/* Floats per latent row of one MLA layer (kv_lora_rank + qk_rope_head_dim); the same on every
 * TP rank, since the latent is shared by all heads. */
int ds_model_latent_row(const ds_model *m);
/* Bytes of one stored latent row (ds_kv_row_bytes of the cache's dtype). Every copier of pages
 * (prefix cache, offload tiers, P/D) moves rows as this many opaque bytes. */
size_t ds_model_latent_row_bytes(const ds_model *m);
/* The dtype of the model's stored latent rows (ds_model_opts.kv_dtype, DS_KV_*). */
int ds_model_kv_dtype(const ds_model *m);

/* Paged MLA latent pool: for each MLA layer j, layer[j] holds [n_pages][block_size][row_bytes]
 * bytes: rows of kv_dtype's form (kernels/shared/kv_row.h) of R = row - dr latent values. */
typedef struct ds_kv_pool {
    uint8_t **layer;   /* [n_mla] pointers (in dm's memory) */
    const ds_dmem *dm; /* the model's memory (ds_model_dmem; NULL: the host's) */
    int n_layers, n_pages, block_size;
    int row;          /* values a row: kv_lora_rank + qk_rope_head_dim */
    size_t row_bytes; /* bytes a stored row (ds_model_latent_row_bytes) */
    int kv_dtype;     /* DS_KV_*: the rows' form */
} ds_kv_pool;

/* MLA layers of this model's stage: the layers a pool page holds rows for. */
int ds_kv_pool_layers(const ds_model *m);
int ds_kv_pool_init(ds_kv_pool *p, const ds_model *m, int n_pages, int block_size, ds_err *err);
void ds_kv_pool_free(ds_kv_pool *p);

/* One sequence's part of a forward step. */
typedef struct ds_seq_batch {
    const int32_t *tokens; /* [n] token ids at positions pos0 .. pos0+n-1 */
    int n;
    int pos0;                   /* tokens already summarised by slot and pages */
    float *slot;                /* [ds_model_slot_floats] KDA state, updated in place */
    const int32_t *block_table; /* pages covering positions [0, pos0+n) */
    float *logits;              /* [n_logits][V] logits of the last n_logits tokens, or NULL */
    int n_logits;
    float *hidden; /* optional [n_layers][n][D]: residual stream after each layer (the block-local
                      sum P with AttnRes), for tests and DSpark taps; NULL to skip */
    float *final_hidden; /* optional [n][D]: normed input of lm_head */
    /* optional DSpark taps: taps[j] [n][D] receives the residual stream after layer
     * tap_layers[j] (the block-local sum P with AttnRes, docs/model.md §8.3); layer -1 is the
     * embedding output */
    const int *tap_layers; /* [n_taps] */
    int n_taps;
    float *taps; /* [n_taps][n][D] */
    /* optional [n][ds_model_slot_floats]: the KDA slot as it is after each token of this segment,
     * so a speculative verify can roll back to the last accepted token by copying one row into
     * the slot. Forces the recurrent KDA form for the segment. */
    float *state_rows;
    /* optional [n_logits]: the greedy token of each of those rows (ds_argmax: the lowest id among
     * the largest logits), found where the logits are. logits may then be NULL: the rows are not
     * returned at all — on a GPU 4 bytes a row cross to the host instead of V floats, which is
     * what lets greedy decoding at large batches skip downloading and scanning the vocabulary
     * on the host. */
    int32_t *argmax;
    /* optional [n_logits], with argmax: row i's token is drawn as draws[i] describes
     * (ds_sample_row: penalties, stops, temperature, top-k/p, min-p, the uniform given) where the
     * logits are, and argmax[i] receives it instead of the greedy token. On one GPU the row never
     * comes to the host. logits, if also wanted, are the rows before the draw's edits. */
    const ds_row_draw *draws;
} ds_seq_batch;

/* Rows of logits a segment asks for, as logits, argmax or both. */
static inline int ds_seq_logit_rows(const ds_seq_batch *sb) {
    return sb->logits || sb->argmax ? sb->n_logits : 0;
}

/* Runs one step over n_seq segments. Segments of the same sequence must not appear twice. */
int ds_model_forward(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq, ds_err *err);

/* ---- pipeline stages ---------------------------------------------------------------------------
 * A model loaded with a layer range runs only those layers: the first stage embeds, the last
 * applies the final AttnRes mix, the norm and lm_head. Between stages crosses, for all T tokens of
 * the step in segment order, the residual stream (the block-local sum P with AttnRes) and the
 * banked AttnRes blocks with their count — nothing else (docs/model.md §6.4). A stage's KDA slot
 * and latent pool hold only its own layers. */
typedef struct ds_stage_io {
    float *h;     /* [T][D] */
    float *banks; /* [ds_model_max_banks][T][D], the first n_banks valid */
    int n_banks;
} ds_stage_io;

int ds_model_first_layer(const ds_model *m);
int ds_model_end_layer(const ds_model *m);
int ds_model_max_banks(const ds_model *m);
/* in: NULL on the first stage; out: NULL on the last. */
int ds_model_forward_stage(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq,
                           const ds_stage_io *in, ds_stage_io *out, ds_err *err);

#endif
