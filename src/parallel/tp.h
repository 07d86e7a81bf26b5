/* tp.h — tensor-parallel rules that do not need the weights: can a model be split T ways, and how
 * wide a rank's MLA query-head block is for the attention kernel. The slicing itself is in
 * model.c (ds_model_opts.tp_rank / tp_size). */
#ifndef DS_TP_H
#define DS_TP_H

#include "io/config.h"

/* The MLA query-head widths per rank an attention kernel is built for: 16, 32, 64, 128, then
 * multiples of 128. Why: the GPU MLA decode kernels this engine targets (FlashMLA- and aiter-style)
 * put a rank's query heads into the row dimension of MMA tiles 16 rows high and are instantiated
 * for a handful of tile counts; a rank whose head count is not one of them is padded with
 * zero-weight heads (their o_proj columns are zero, so the result is unchanged). K3's 96 heads give
 * 24 per rank at T = 4 (padded to 32) and 12 at T = 8 (padded to 16).
 * The CPU kernels take any width, so the CPU forward never pads; the rule is here so that the GPU
 * path and the memory planner agree on it. */
int ds_tp_mla_padded_heads(int heads_per_rank);

/* Start-up check of a config for T ranks: KDA heads, MLA heads, routed experts, the dense and the
 * shared-expert intermediate sizes must all divide by T. The message names every one that does
 * not. (ds_model_load checks the same through ds_model_tp_check; this is for the launcher, before
 * any rank is started.) */
int ds_tp_check_dir(const char *model_dir, int T, ds_err *err);

#endif
