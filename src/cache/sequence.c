/* sequence.c — a sequence's token buffer and block table, and the cut rule of its steps. */
#include "cache/sequence.h"

#include <stdlib.h>
#include <string.h>

ds_seq *ds_seq_new(int64_t id, const int32_t *prompt, int n_prompt, int max_len, ds_err *err) {
    if (n_prompt < 1) {
        ds_errf(err, "sequence %lld: empty prompt", (long long)id);
        return NULL;
    }
    if (max_len < n_prompt) {
        ds_errf(err, "sequence %lld: prompt of %d tokens is longer than max_len %d", (long long)id,
                n_prompt, max_len);
        return NULL;
    }
    ds_seq *s = ds_calloc(1, sizeof *s, err);
    if (!s) return NULL;
    /* Room for the prompt and a few generated tokens; ds_seq_append doubles up to max_len. The
     * buffer is not sized max_len up front: a queue of long-context requests would pin
     * max_len * 4 bytes each while most stop early. */
    s->cap = DS_MIN(max_len, n_prompt + 16);
    s->tokens = ds_malloc((size_t)s->cap * sizeof *s->tokens, err);
    if (!s->tokens) {
        free(s);
        return NULL;
    }
    memcpy(s->tokens, prompt, (size_t)n_prompt * sizeof *prompt);
    s->id = id;
    s->n_tokens = n_prompt;
    s->n_prompt = n_prompt;
    s->slot = -1;
    s->fork_ckpt = -1;
    s->group = -1;
    s->status = DS_SEQ_WAITING;
    s->max_len = max_len;
    return s;
}

int ds_seq_append(ds_seq *s, int32_t token, ds_err *err) {
    if (s->n_tokens >= s->max_len)
        return ds_errf(err, "sequence %lld: already holds max_len = %d tokens", (long long)s->id,
                       s->max_len);
    if (s->n_tokens == s->cap) {
        int cap = DS_MIN(s->max_len, s->cap > s->max_len / 2 ? s->max_len : 2 * s->cap);
        int32_t *t = realloc(s->tokens, (size_t)cap * sizeof *t);
        if (!t)
            return ds_errf(err, "sequence %lld: out of memory growing to %d tokens",
                           (long long)s->id, cap);
        s->tokens = t;
        s->cap = cap;
    }
    s->tokens[s->n_tokens++] = token;
    return DS_OK;
}

void ds_seq_free(ds_seq *s) {
    if (!s) return;
    free(s->tokens);
    free(s->block_table);
    free(s->entry);
    free(s->rungs);
    free(s);
}

int ds_seq_reserve_blocks(ds_seq *q, int need) {
    if (q->cap_blocks >= need) return DS_OK;
    int cap = DS_MAX(need, DS_MAX(2 * q->cap_blocks, 4));
    int32_t *t = realloc(q->block_table, (size_t)cap * sizeof *t);
    if (!t) return DS_ERR;
    q->block_table = t;
    int32_t *e = realloc(q->entry, (size_t)cap * sizeof *e);
    if (!e) return DS_ERR; /* cap_blocks unchanged: the larger table is simply not used yet */
    q->entry = e;
    q->cap_blocks = cap;
    return DS_OK;
}

/* End of q's next item. A sequence's cuts are its own: the absolute multiples of chunk_tokens,
 * the end of its prompt, and n_tokens. They depend on nothing else — not on its neighbours, not
 * on whether prefix caching is on or what the cache holds — so a request computes every row the
 * same way whatever happens around it (docs/prefix-cache.md, "The numeric contract"). The prefix
 * cache only ever files checkpoints at these cuts; it adds none. */
int ds_seq_next_cut(const ds_seq *q, int chunk_tokens, int block_size) {
    int p = q->n_computed;
    int cut = (p / chunk_tokens + 1) * chunk_tokens;
    (void)block_size;
    if (q->n_prompt > p) cut = DS_MIN(cut, q->n_prompt);
    return DS_MIN(q->n_tokens, cut);
}
