/* sampling.c — the engine's sampling glue: the stop ids of a request, where a choice's tokens of a
 * step are picked (greedy beside the logits, drawn where the logits are, or sampled here from rows
 * that came back), choosing a token with the choice's own RNG and counts, and delivering it (the
 * sequence, the text, the event, the finish). */
#include "engine/engine_impl.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The tokens that end a choice: eos (unless ignored: a grammar's end is eos, always a stop) and
 * the request's stop ids. */
static int stop_ids_of(const ds_engine *e, const ds_request_params *p, int32_t *ids) {
    int n = 0;
    if (!p->ignore_eos || p->grammar) ids[n++] = ds_model_config(e->model)->eos_token_id;
    for (int i = 0; i < p->n_stop_token_ids; i++) ids[n++] = p->stop_token_ids[i];
    return n;
}

/* Can the model pick this choice's tokens of the coming step itself (ds_seq_batch.argmax), so
 * that its logits need not come back? When every row the step samples for it is a plain argmax
 * for its sampler (ds_sample_is_argmax); rows further ahead only allow stops more, so the first
 * row decides for all. */
int eng_picks_greedy(const ds_engine *e, const choice *ch) {
    const ds_request_params *p = &ch->req->spec.params;
    int32_t stop_ids[DS_MAX_STOP + 1];
    const ds_sample_params sp = p->sample;
    if (p->grammar) return 0; /* its mask is applied here, on the row */
    return ds_sample_is_argmax(&sp, ch->n_generated >= p->min_tokens, stop_ids_of(e, p, stop_ids),
                               p->logprobs);
}

/* Can the model draw this choice's tokens of the coming step where the logits are
 * (ds_seq_batch.draws), so that the rows need not come back? Every sampled row can, except where
 * logprobs are wanted (they read the whole row). */
int eng_model_draws(const choice *ch) {
    return ch->req->spec.params.logprobs < 0;
}

/* llguidance over the model's vocabulary, made on first use (a server that never sees a
 * constrained request never loads it). NULL with err when it cannot be. */
static ds_grammars *grammars(ds_engine *e, ds_err *err) {
    pthread_mutex_lock(&e->gmu);
    if (!e->g_tried) {
        e->g_tried = 1;
        ds_err ge = {{0}};
        /* 64 compiled grammars: a schema costs ~1-100 ms to compile, and clients repeat theirs */
        if (ds_grammars_new(e->tok, ds_model_config(e->model)->eos_token_id, 64, &e->grammars, &ge))
            snprintf(e->g_why, sizeof e->g_why, "%s", ge.msg);
    }
    ds_grammars *g = e->grammars;
    if (!g) ds_errf(err, "%s", e->g_why);
    pthread_mutex_unlock(&e->gmu);
    return g;
}

int ds_engine_grammar_ready(ds_engine *e, ds_err *err) {
    return grammars(e, err) != NULL;
}

int ds_engine_grammar_check(ds_engine *e, const char *lark, ds_err *err) {
    ds_grammars *g = grammars(e, err);
    return g ? ds_grammar_check(g, lark, err) : DS_ERR;
}

/* A constrained choice's row before it is sampled: tokens its grammar forbids get -inf. The
 * matcher is made at the choice's first sample (on the sampling rank only: the other ranks of a
 * job take the tokens it chose). A grammar that cannot be followed (it compiled when the request
 * came, so only a failure of the library) forces eos, said once on stderr. */
/* The choice's matcher, made at its first sample; 0 when the grammar cannot be followed. */
static int grammar_matcher(ds_engine *e, choice *ch, ds_err *err) {
    if (!ch->gm && !ch->gm_broken) {
        ds_grammars *g = grammars(e, err);
        if (!g || ds_matcher_new(g, ch->req->spec.params.grammar, &ch->gm, err) ||
            !(ch->gmask = malloc((size_t)ds_grammars_mask_words(g) * 4)))
            ch->gm_broken = 1;
    }
    return !ch->gm_broken;
}

static void grammar_mask(ds_engine *e, choice *ch, float *row) {
    ds_err err = {{0}};
    if (grammar_matcher(e, ch, &err) && ds_matcher_mask(ch->gm, ch->gmask, &err)) ch->gm_broken = 1;
    if (ch->gm_broken) {
        if (err.msg[0]) fprintf(stderr, "deltaserve: constrained output ended: %s\n", err.msg);
        int32_t eos = ds_model_config(e->model)->eos_token_id;
        for (int i = 0; i < e->V; i++)
            if (i != eos) row[i] = -INFINITY;
        return;
    }
    ds_sample_mask_bits(row, e->V, ch->gmask, ds_tok_vocab_size(e->tok));
}

/* Penalised counts a step's draws of one choice need: each row's table and the drafts before it. */
size_t eng_draw_counts_need(const choice *ch, int n_rows) {
    const ds_request_params *p = &ch->req->spec.params;
    if (p->sample.presence_penalty == 0 && p->sample.frequency_penalty == 0) return 0;
    return (size_t)n_rows * ((size_t)ch->counts.n + (size_t)n_rows);
}

/* The allowed-ids bitmask of each of a constrained choice's n_rows rows, into allow[n_rows][W]:
 * row j's as the matcher stands after drafts 0..j-1 (taken in, then rolled back). A row behind a
 * draft the grammar forbids (or behind eos) is never reached, since that draft cannot be the
 * token sampled before it: it gets its predecessor's mask. When the grammar cannot be followed
 * only eos is allowed, as grammar_mask does. */
static void grammar_row_masks(ds_engine *e, choice *ch, const int32_t *drafts, int n_rows,
                              uint32_t *allow) {
    ds_err err = {{0}};
    const int32_t eos = ds_model_config(e->model)->eos_token_id;
    const int nb = ds_tok_vocab_size(e->tok), W = (nb + 31) / 32;
    int taken = 0, j = 0;
    if (grammar_matcher(e, ch, &err)) {
        for (; j < n_rows; j++) {
            uint32_t *a = allow + (size_t)j * W;
            if (ds_matcher_mask(ch->gm, a, &err)) break;
            if (j + 1 == n_rows) continue;
            int32_t t = drafts[j];
            if (t == eos || t < 0 || t >= nb || !(a[t / 32] >> (t % 32) & 1u)) {
                for (int k = j + 1; k < n_rows; k++)
                    memcpy(allow + (size_t)k * W, a, (size_t)W * 4);
                j = n_rows;
                break;
            }
            if (ds_matcher_consume(ch->gm, t, &err)) break;
            taken++;
        }
        if (taken && ds_matcher_rollback(ch->gm, taken, &err)) j = -1;
        if (j == n_rows) return;
    }
    fprintf(stderr, "deltaserve: constrained output ended: %s\n", err.msg);
    ch->gm_broken = 1;
    memset(allow, 0, (size_t)n_rows * W * 4);
    for (int k = 0; k < n_rows; k++) allow[(size_t)k * W + eos / 32] |= 1u << (eos % 32);
}

uint32_t *eng_allow_rows(ds_engine *e, int i) {
    const size_t W = ((size_t)ds_tok_vocab_size(e->tok) + 31) / 32;
    const size_t R = (size_t)e->num_speculative_tokens + 1;
    if (!e->dallow) e->dallow = malloc((size_t)e->opts.max_num_seqs * R * W * 4);
    return e->dallow ? e->dallow + (size_t)i * R * W : NULL;
}

/* Constrained items of f whose rows the model draws (their masks to make). */
static int n_mask_items(const ds_engine *e, const inflight *f) {
    int n = 0;
    for (int i = 0; i < f->n_items; i++) {
        const choice *ch = f->items[i].seq->owner;
        n += e->batch[i].draws && ch->req->spec.params.grammar;
    }
    return n;
}

/* The items are independent (one matcher each; the grammar cache is thread-safe), so their masks
 * are made side by side. Their mask memory was made by eng_allow_rows as the batch was built. */
void eng_grammar_masks(ds_engine *e, inflight *f) {
    int n = n_mask_items(e, f);
    if (!n) return;
    const double t0 = ds_now();
#pragma omp parallel for schedule(dynamic) num_threads(e->n_scratch) if (n > 1)
    for (int i = 0; i < f->n_items; i++) {
        const ds_sched_item *it = &f->items[i];
        choice *ch = it->seq->owner;
        if (!e->batch[i].draws || !ch->req->spec.params.grammar) continue;
        int rows = it->seq->n_spec ? it->seq->n_spec + 1 : 1;
        grammar_row_masks(e, ch, it->seq->tokens + it->pos0 + 1, rows, eng_allow_rows(e, i));
    }
    e->g_mask_s += ds_now() - t0;
}

/* ---- the masks beside the forward ------------------------------------------------------------
 * llguidance's masks cost ~0.1-1 ms a row at real vocabularies; made before the forward is
 * launched, a GPU waits for them (issue 34: +8% a step at batch 32 on the H200). With mask_async
 * the step is launched first and this thread makes them while it runs; the backend waits for
 * them (ds_model_set_draw_wait) just before the draws read them, and the engine thread waits
 * again after the forward, so nothing else touches the matchers meanwhile. */

static void *mask_main(void *arg) {
    ds_engine *e = arg;
    pthread_mutex_lock(&e->mask_mu);
    for (;;) {
        while (!e->mask_job && !e->mask_stop) pthread_cond_wait(&e->mask_cv, &e->mask_mu);
        if (!e->mask_job) break; /* stopping, nothing posted */
        inflight *f = e->mask_job;
        pthread_mutex_unlock(&e->mask_mu);
        eng_grammar_masks(e, f);
        pthread_mutex_lock(&e->mask_mu);
        e->mask_job = NULL;
        pthread_cond_broadcast(&e->mask_cv);
    }
    pthread_mutex_unlock(&e->mask_mu);
    return NULL;
}

static void draw_wait(void *ctx) {
    eng_masks_wait(ctx);
}

int eng_masks_start(ds_engine *e, ds_err *err) {
    if (!e->mask_async) return DS_OK;
    pthread_mutex_init(&e->mask_mu, NULL);
    pthread_cond_init(&e->mask_cv, NULL);
    if (pthread_create(&e->mask_thread, NULL, mask_main, e)) {
        pthread_cond_destroy(&e->mask_cv);
        pthread_mutex_destroy(&e->mask_mu);
        e->mask_async = 0;
        return ds_errf(err, "engine: cannot start the grammar-mask thread");
    }
    ds_model_set_draw_wait(e->model, draw_wait, e);
    return DS_OK;
}

void eng_masks_stop(ds_engine *e) {
    if (!e->mask_async) return;
    ds_model_set_draw_wait(e->model, NULL, NULL);
    pthread_mutex_lock(&e->mask_mu);
    e->mask_stop = 1;
    pthread_cond_broadcast(&e->mask_cv);
    pthread_mutex_unlock(&e->mask_mu);
    pthread_join(e->mask_thread, NULL);
    pthread_cond_destroy(&e->mask_cv);
    pthread_mutex_destroy(&e->mask_mu);
    e->mask_async = 0;
}

void eng_masks_post(ds_engine *e, inflight *f) {
    if (!e->mask_async) {
        const double m0 = e->g_mask_s;
        eng_grammar_masks(e, f);
        e->g_wait_s += e->g_mask_s - m0; /* the step waits for all of it */
        return;
    }
    if (!n_mask_items(e, f)) return;
    pthread_mutex_lock(&e->mask_mu);
    e->mask_job = f;
    pthread_cond_broadcast(&e->mask_cv);
    pthread_mutex_unlock(&e->mask_mu);
}

void eng_masks_wait(ds_engine *e) {
    if (!e->mask_async) return;
    pthread_mutex_lock(&e->mask_mu);
    if (e->mask_job) {
        const double t0 = ds_now();
        while (e->mask_job) pthread_cond_wait(&e->mask_cv, &e->mask_mu);
        e->g_wait_s += ds_now() - t0;
    }
    pthread_mutex_unlock(&e->mask_mu);
}

/* Row j of a choice's step, as ds_row_draw: the uniform plain decoding would draw for its token
 * (the RNG is only peeked: eng_choose moves it as each row is taken), the counts of the tokens
 * generated before it (the choice's, then the drafts at rows 0..j-1, which are its tokens if row j
 * is reached at all), the stop ids masked while min_tokens is not reached, and for a constrained
 * choice where its row's mask will be (eng_grammar_masks fills them). counts: room for
 * eng_draw_counts_need entries; stops: room for DS_MAX_STOP + 1. */
void eng_set_draws(ds_engine *e, choice *ch, const int32_t *drafts, int n_rows, ds_row_draw *d,
                   ds_token_count *counts, int32_t *stops, uint32_t *allow) {
    const ds_request_params *p = &ch->req->spec.params;
    const ds_sample_params sp = p->sample;
    int n_stop = stop_ids_of(e, p, stops), penalise = eng_draw_counts_need(ch, 1) > 0;
    /* the masks themselves are computed by eng_grammar_masks, for all items side by side */
    int n_allow = p->grammar ? ds_tok_vocab_size(e->tok) : 0;
    ds_rng rng = ch->rng;
    for (int j = 0; j < n_rows; j++) {
        int allow_stop = ch->n_generated + j >= p->min_tokens, n = 0;
        d[j] = (ds_row_draw){sp, 0, NULL, 0, stops, allow_stop ? 0 : n_stop, NULL, 0};
        if (ds_sample_draws_uniform(&sp)) d[j].u = ds_rng_uniform(&rng);
        if (n_allow) {
            d[j].allow = allow + (size_t)j * ((n_allow + 31) / 32);
            d[j].n_allow = n_allow;
            d[j].n_mask = 0; /* the grammar decides when it may end (eng_choose) */
        }
        if (!penalise) continue;
        for (int i = 0; i < ch->counts.cap; i++)
            if (ch->counts.slots[i].id >= 0) counts[n++] = ch->counts.slots[i];
        for (int t = 0; t < j; t++) { /* the drafts before row j, merged: one entry an id */
            int at = 0;
            while (at < n && counts[at].id != drafts[t]) at++;
            if (at == n) counts[n++] = (ds_token_count){drafts[t], 0};
            counts[at].count++;
        }
        d[j].counts = counts;
        d[j].n_counts = n;
        counts += n;
    }
}

/* Samples a choice's next token from one logits row, or takes the token the model picked for it
 * (row NULL, *pick): its greedy token (eng_picks_greedy) or its draw (drawn: eng_set_draws, which
 * gave it this row's uniform; the RNG moves past it here, as ds_sample_token would have moved it).
 * `ahead` tokens of this step were already chosen (and counted) before it, so min_tokens and
 * penalties see exactly what plain decoding would. Draws from the choice's own RNG. */
int32_t eng_choose(ds_engine *e, choice *ch, float *row, const int32_t *pick, int drawn,
                   ds_sample_scratch *sc, int ahead, ds_logprobs_out *lp) {
    const ds_request_params *p = &ch->req->spec.params;
    int32_t stop_ids[DS_MAX_STOP + 1];
    int n_stop = stop_ids_of(e, p, stop_ids);
    const ds_sample_params sp = p->sample;
    /* a grammar decides when the output may end (min_tokens would mask its forced eos) */
    int allow_stop = ch->n_generated + ahead >= p->min_tokens || p->grammar;
    if (p->grammar && row) grammar_mask(e, ch, row);
    int32_t tok =
        row ? ds_sample_token(row, e->V, &sp, &ch->counts, allow_stop, stop_ids, n_stop, &ch->rng,
                              sc, p->logprobs >= 0 ? lp : NULL, p->logprobs > 0 ? p->logprobs : 0)
            : *pick;
    if (!row && drawn && ds_sample_draws_uniform(&sp)) (void)ds_rng_uniform(&ch->rng);
    ds_err err = {{0}};
    if (ch->gm && !ch->gm_broken) {
        const double t0 = ds_now();
        if (ds_matcher_consume(ch->gm, tok, &err)) {
            fprintf(stderr, "deltaserve: constrained output ended: %s\n", err.msg);
            ch->gm_broken = 1;
        }
        e->g_accept_s += ds_now() - t0;
    }
    ds_token_counts_add(&ch->counts, tok);
    return tok;
}

/* Hands a chosen token to the client: appends it to the sequence (unless a verify already holds
 * it there as an accepted draft), feeds the text, emits the event, and finishes the choice on a
 * stop or the length limit. Returns 1 when the choice finished (it may be freed by then). */
int eng_deliver(ds_engine *e, choice *ch, int32_t tok, const ds_logprobs_out *lp, int in_seq) {
    const ds_request_params *p = &ch->req->spec.params;
    int32_t stop_ids[DS_MAX_STOP + 1];
    int n_stop = stop_ids_of(e, p, stop_ids);
    int allow_stop = ch->n_generated >= p->min_tokens || p->grammar;
    ch->n_generated++;
    ds_err err;
    ds_seq *s = ch->seq;
    int is_stop_tok = 0;
    for (int i = 0; i < n_stop; i++) is_stop_tok |= tok == stop_ids[i];
    if (!in_seq && ds_seq_append(s, tok, &err)) {
        eng_finish_choice(e, ch, DS_FINISH_ERROR);
        return 1;
    }
    pthread_mutex_lock(&e->mu);
    e->stats.generation_tokens_total++;
    pthread_mutex_unlock(&e->mu);
    const char *delta = NULL;
    size_t dlen = 0;
    int stopped = 0;
    if (!(is_stop_tok && allow_stop) &&
        !(p->skip_special_tokens && ds_tok_is_special(e->tok, tok))) {
        size_t blen = 0;
        const char *bytes = ds_tok_token_bytes(e->tok, tok, &blen);
        ds_textout_push(&ch->text, bytes ? bytes : "", bytes ? blen : 0, &delta, &dlen, &stopped);
    }
    ds_finish fin = DS_FINISH_NONE;
    if ((is_stop_tok && allow_stop) || stopped)
        fin = DS_FINISH_STOP;
    else if (ch->n_generated >= p->max_tokens || s->n_tokens >= s->max_len)
        fin = DS_FINISH_LENGTH;
    eng_emit(ch, tok, delta, dlen, lp, DS_FINISH_NONE);
    if (fin == DS_FINISH_NONE) return 0;
    eng_finish_choice(e, ch, fin);
    return 1;
}

/* Every sampled item's tokens of step f: a verify samples its rows until a draft is rejected, a
 * plain item samples one. The items side by side when more than one samples on the host (at
 * V = 163840 a row costs ~1 ms of one core): each choice samples from its own rows with its own
 * RNG and counts, so neither the order nor the thread changes what it draws. */
void eng_sample_items(ds_engine *e, inflight *f) {
    const int n_items = f->n_items, rows = e->num_speculative_tokens + 1;
    int n_host = 0;
    for (int i = 0; i < n_items; i++) n_host += f->items[i].sample && e->batch[i].logits;
#pragma omp parallel for schedule(dynamic) num_threads(e->n_scratch) if (n_host > 1)
    for (int i = 0; i < n_items; i++) {
        ds_sched_item *it = &f->items[i];
        choice *ch = it->seq->owner;
        ds_sample_scratch *sc = e->scratch[omp_get_thread_num()];
        float *lg = e->batch[i].logits;            /* or NULL, and then: */
        const int32_t *picks = e->batch[i].argmax; /* the greedy tokens */
        f->va[i] = -1;
        if (!it->sample) continue;
        int drawn = e->batch[i].draws != NULL;
        if (it->seq->n_spec)
            f->va[i] =
                eng_verify(e, ch, it, lg, picks, drawn, sc, f->vt[i], f->vlp + (size_t)i * rows);
        else
            f->vt[i][0] = eng_choose(e, ch, lg, picks, drawn, sc, 0, &f->vlp[(size_t)i * rows]);
    }
}
