/* pipeline.h — pipeline-parallel stages: which layers a stage runs, and handing the stage's
 * tensors (ds_stage_io, docs/model.md §6.4) to the next stage through the comm. */
#ifndef DS_PIPELINE_H
#define DS_PIPELINE_H

#include "transport/comm.h"
#include "model/model.h"

/* Splits L layers over P stages into counts[P] (each >= 1, summing to L).
 * spec NULL or "": even split, and the remainder r = L % P goes one layer each to r consecutive
 * middle stages starting at (P - r) / 2 — 10 layers over 4 stages give 2,3,3,2. The first and last
 * stages carry extra work (embedding; final norm and lm_head), so they are the last to get an extra
 * layer; when the middle cannot be centred the first stage is preferred, since a row lookup costs
 * less than the lm_head GEMM.
 * spec "2,3,3,2" (--pp-layer-partition): taken as given, checked to have P entries >= 1 summing
 * to L. */
int ds_pp_partition(int L, int P, const char *spec, int *counts, ds_err *err);

/* The checks every rank would otherwise make for itself, made once before any rank exists: the
 * split fits the model in model_dir (TP divisibility, the layer partition). counts: [pp]. */
int ds_pp_check_split(const char *model_dir, int tp, int pp, const char *partition, int *counts,
                      ds_err *err);

/* Layer range [*begin, *end) of `stage` under counts[P]. */
void ds_pp_stage_range(const int *counts, int stage, int *begin, int *end);

/* Banked AttnRes blocks crossing the boundary in front of layer `layer` (>= 1): floor((layer-1)/N)
 * + 1 with N = attn_res_block_size (docs/model.md §6.4); 0 when AttnRes is off (N == 0). */
int ds_pp_banks_before(int attn_res_block_size, int layer);

/* Sends io (h [T][D], then banks [n_banks][T][D]) to stage c->stage + 1, same tp_rank. */
int ds_pp_send(ds_comm *c, const ds_stage_io *io, int T, int D, ds_err *err);
/* Receives from stage c->stage - 1 into io; n_banks is what the receiver expects
 * (ds_pp_banks_before of its first layer) and is stored in io->n_banks. */
int ds_pp_recv(ds_comm *c, ds_stage_io *io, int T, int D, int n_banks, ds_err *err);

/* Stage-boundary buffers of one rank: io[0] receives, io[1] sends; sized for cap_tokens tokens. */
typedef struct ds_pp_bufs {
    ds_stage_io io[2]; /* h [cap_tokens][D], banks [max_banks][cap_tokens][D] each */
    int cap_tokens;
} ds_pp_bufs;

/* This rank's part of the model in o: its stage's layers (counts[P] layers per stage; NULL with
 * one stage), its TP slice, and the comm's collectives as the model's callbacks. */
void ds_pp_rank_opts(ds_comm *c, const int *counts, ds_model_opts *o);

/* Grows b to hold T tokens of model m (never shrinks). */
int ds_pp_bufs_reserve(ds_pp_bufs *b, const ds_model *m, int T, ds_err *err);
void ds_pp_bufs_free(ds_pp_bufs *b);

/* One forward step of this rank's stage: receive the stream of all the step's tokens from the
 * previous stage (unless first), run this stage's layers over seqs[n_seq], send to the next stage
 * (unless last). Every rank of the job calls it with the same segments. With one stage it is
 * ds_model_forward. */
int ds_pp_step(ds_comm *c, ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq,
               ds_pp_bufs *b, ds_err *err);

#endif
