/* draw.c — the rows of a step's logits that are drawn (ds_seq_batch.draws) on the CUDA backend.
 * On one GPU the rows are drawn where they are (ds_cu_draw_rows: the host's definition, the same
 * token); a TP group's rows are gathered on the host anyway, and drawn there (draw_host.h). */
#include "backend/cuda/internal.h"

/* Rows of the step's logits (in segment order) that are drawn: *n of them, their draws d[*n]
 * and where their tokens go out[*n], in s->draw_* (grown here). */
static int draw_rows(cstep *s, int *n, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    int cnt = 0;
    for (int q = 0; q < s->n_seq; q++)
        if (s->seqs[q].draws && s->seqs[q].argmax) cnt += ds_seq_logit_rows(&s->seqs[q]);
    *n = cnt;
    if (!cnt) return DS_OK;
    /* the forward is enqueued: the masks may have been filled beside it until now */
    ds_model_draw_wait(s->m);
    if (cuda_grow_host((void **)&cm->draw_d, &cm->draw_d_cap, (size_t)s->n_lg,
                       sizeof(const ds_row_draw *), err) ||
        cuda_grow_host((void **)&cm->draw_out, &cm->draw_out_cap, (size_t)s->n_lg,
                       sizeof(int32_t *), err))
        return DS_ERR;
    for (int q = 0, r = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        int drawn = sb->draws && sb->argmax;
        for (int i = 0; i < ds_seq_logit_rows(sb); i++, r++) {
            cm->draw_d[r] = drawn ? &sb->draws[i] : NULL;
            cm->draw_out[r] = drawn ? &sb->argmax[i] : NULL;
        }
    }
    return DS_OK;
}

size_t ds_cuda_pack_draw(const ds_row_draw *d, int V, int row, size_t at, int32_t *edits,
                         struct ds_cu_draw *out) {
    const ds_sample_params *p = &d->p;
    const ds_draw_numbers nb = ds_sample_numbers(p, V); /* what sampler.c's draw() reads */
    *out = (ds_cu_draw){
        .u = d->u,
        .inv_t = nb.inv_t,
        .top_p = p->top_p,
        .min_w = nb.min_w,
        .presence = d->n_counts ? p->presence_penalty : 0.0f,
        .frequency = d->n_counts ? p->frequency_penalty : 0.0f,
        .greedy = nb.greedy,
        .top_k = nb.top_k,
        .row = row,
        .edits = (int)at,
        .n_counts = d->n_counts,
        .n_mask = d->n_mask,
        .n_allow = d->n_allow > 0 ? d->n_allow : 0,
    };
    size_t e = at;
    for (int i = 0; i < d->n_counts; i++) {
        edits[e++] = d->counts[i].id;
        edits[e++] = d->counts[i].count;
    }
    for (int i = 0; i < d->n_mask; i++) edits[e++] = d->mask[i];
    for (int i = 0; i < (out->n_allow + 31) / 32; i++) edits[e++] = (int32_t)d->allow[i];
    return e - at;
}

/* A TP group's gathered rows all [Tp][n_lg][vp] (host): its draws, on the host. */
int cuda_draw_gathered(cstep *s, const float *all, ds_err *err) {
    int n;
    TRY(draw_rows(s, &n, err));
    if (n)
        ds_host_draws_run(&s->cm->draws, s->m->cfg.vocab_size, all, (size_t)s->n_lg * s->m->vp,
                          s->m->vp, s->n_lg, s->cm->draw_d, s->cm->draw_out);
    return DS_OK;
}

/* One GPU: the step's drawn rows of s->lg, drawn there; 4 bytes a row come back. */
int cuda_draw_on_device(cstep *s, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    const ds_model *m = s->m;
    int n, V = m->cfg.vocab_size;
    TRY(draw_rows(s, &n, err));
    if (!n) return DS_OK;
    size_t n_edits = 0;
    for (int r = 0; r < s->n_lg; r++)
        if (cm->draw_d[r])
            n_edits += 2 * (size_t)cm->draw_d[r]->n_counts + cm->draw_d[r]->n_mask +
                       (size_t)(DS_MAX(cm->draw_d[r]->n_allow, 0) + 31) / 32;
    if (cuda_grow_host((void **)&cm->draw_cu, &cm->draw_cu_cap, (size_t)n, sizeof(ds_cu_draw),
                       err) ||
        cuda_grow_host((void **)&cm->draw_ed, &cm->draw_ed_cap, DS_MAX(n_edits, 1), sizeof(int32_t),
                       err) ||
        cuda_grow_host((void **)&cm->draw_tok, &cm->draw_tok_cap, (size_t)n, sizeof(int32_t), err))
        return DS_ERR;
    size_t e = 0;
    for (int r = 0, j = 0; r < s->n_lg; r++)
        if (cm->draw_d[r])
            e += ds_cuda_pack_draw(cm->draw_d[r], V, r, e, cm->draw_ed, &cm->draw_cu[j++]);
    TRY(ds_cu_draw_rows(cm->c, cm->draw_tok, s->lg, (size_t)m->vp, V, cm->draw_cu, n, cm->draw_ed,
                        e, err));
    for (int r = 0, j = 0; r < s->n_lg; r++)
        if (cm->draw_d[r]) *cm->draw_out[r] = cm->draw_tok[j++];
    return DS_OK;
}
