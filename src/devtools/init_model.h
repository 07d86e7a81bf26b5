/* init_model.h — writes a random-initialised checkpoint in exactly the published Hugging Face
 * layout (config.json, safetensors — one file or shards plus model.safetensors.index.json —,
 * tiktoken.model and tokenizer_config.json), for tests, demos and benchmarks without downloading
 * real weights.
 *
 * Presets (ds_init_model_presets lists them):
 *   tiny-k3      Kimi-K3 layout: root "kimi_k3" with the text model under text_config, weights
 * under "language_model.", AttnRes, latent MoE, SiTU, K3 gate forms, F32 where K3 has F32, A_log
 * [2*Hk] with only Hk live entries; plus a DSpark draft in OUT/draft/. tiny-linear  Kimi-Linear
 * layout (top-level config, no prefix, q_proj without q-LoRA, low-rank output gate, A_log
 * [1,1,Hk,1]); written as two shards with an index. bench-large  Kimi-Linear structure with ~1 B
 * BF16 parameters (~2 GB), ~500 MB shards.
 *
 * The bytes written depend only on (preset, seed): every tensor draws from its own RNG stream,
 * keyed by the seed and the tensor's name and split into fixed chunks, so the output is the same on
 * any machine and for any number of threads. */
#ifndef DS_INIT_MODEL_H
#define DS_INIT_MODEL_H

#include "base/ds_base.h"

/* Writes preset `preset` into out_dir (created if missing, with parents). Files of an earlier
 * checkpoint that would confuse a loader (model*.safetensors, model.safetensors.index.json, the
 * draft/ folder's config and weights) are removed first; nothing else in out_dir is touched. */
int ds_init_model(const char *preset, const char *out_dir, uint64_t seed, ds_err *err);

/* The same, with the routed experts written as compressed-tensors MXFP4 when mxfp4 is set
 * (weight_packed + weight_scale, and a quantization_config saying so): the MXFP4 rounding of the
 * BF16 experts the same preset and seed write (docs/quantization.md §2). */
int ds_init_model_ex(const char *preset, const char *out_dir, uint64_t seed, int mxfp4,
                     ds_err *err);

/* The shape of a real model without its weights: out_dir gets config_dir's config.json and a
 * tokenizer of its vocabulary (ds_tok_write_files, as many ordinary tokens as bos_token_id says),
 * so that `serve --load-format dummy` can run the shape behind the HTTP API (benchmarks at
 * Kimi-Linear-48B's shape on one GPU). */
int ds_init_shape(const char *config_dir, const char *out_dir, ds_err *err);

/* NULL-terminated list of preset names. */
const char *const *ds_init_model_presets(void);

/* One line describing a preset, or NULL for an unknown name. */
const char *ds_init_model_describe(const char *preset);

#endif
