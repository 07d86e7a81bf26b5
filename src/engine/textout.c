/* textout.c — incremental UTF-8 repair and stop-string hold-back; see textout.h. */
#include "engine/textout.h"

#include <stdlib.h>

static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD}; /* U+FFFD */

/* ---- UTF-8 repair ------------------------------------------------------------------------------
 */

/* Decodes byte b given the pending partial sequence part[0..*have) of *need bytes and writes the
 * bytes that became final text to out (at most 6: a U+FFFD for a broken partial, then b's own
 * U+FFFD). The second byte's range excludes overlongs (E0, F0), surrogates (ED) and code points
 * past U+10FFFF (F4), as Unicode's table of well-formed sequences does. */
static int utf8_feed(unsigned char *part, int *have, int *need, unsigned char b, char *out) {
    int n = 0;
    if (*need) {
        unsigned char lo = 0x80, hi = 0xBF;
        if (*have == 1) switch (part[0]) {
            case 0xE0:
                lo = 0xA0;
                break;
            case 0xED:
                hi = 0x9F;
                break;
            case 0xF0:
                lo = 0x90;
                break;
            case 0xF4:
                hi = 0x8F;
                break;
            }
        if (b >= lo && b <= hi) {
            part[(*have)++] = b;
            if (*have < *need) return 0;
            memcpy(out, part, (size_t)*need);
            n = *need;
            *have = *need = 0;
            return n;
        }
        memcpy(out, REPLACEMENT, 3); /* the partial is a maximal invalid subpart; b starts anew */
        n = 3;
        *have = *need = 0;
    }
    if (b < 0x80) {
        out[n++] = (char)b;
    } else if (b >= 0xC2 && b <= 0xF4) {
        part[0] = b;
        *have = 1;
        *need = b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    } else { /* a stray continuation byte, C0/C1 (always overlong) or F5..FF */
        memcpy(out + n, REPLACEMENT, 3);
        n += 3;
    }
    return n;
}

/* ---- stop strings ------------------------------------------------------------------------------
 */

/* Advances every stop string's automaton over byte c. Returns the length of the longest stop
 * string that completes at c, or 0. */
static size_t match_byte(ds_textout *t, char c) {
    size_t hit = 0;
    for (int i = 0; i < t->n_stops; i++) {
        ds_textout_stop *s = &t->stops[i];
        size_t st = s->state;
        while (st > 0 && s->s[st] != c) st = s->fail[st - 1];
        if (s->s[st] == c) st++;
        if (st == s->len) {
            hit = DS_MAX(hit, s->len);
            st = s->fail[st - 1];
        }
        s->state = st;
    }
    return hit;
}

/* The longest tail of the text that is a proper prefix of some stop string: it must wait. */
static size_t held_tail(const ds_textout *t) {
    size_t h = 0;
    for (int i = 0; i < t->n_stops; i++) h = DS_MAX(h, t->stops[i].state);
    return h;
}

int ds_textout_init(ds_textout *t, char *const *stops, int n_stops, ds_err *err) {
    memset(t, 0, sizeof *t);
    t->cap = 64;
    t->buf = ds_malloc(t->cap, err);
    if (!t->buf) return DS_ERR;
    if (n_stops > 0) {
        t->stops = ds_calloc((size_t)n_stops, sizeof *t->stops, err);
        if (!t->stops) goto fail;
    }
    for (int i = 0; i < n_stops; i++) {
        size_t n = stops[i] ? strlen(stops[i]) : 0;
        if (!n) continue;
        ds_textout_stop *s = &t->stops[t->n_stops];
        s->s = ds_malloc(3 * n + 3, err); /* each byte yields at most 3 after repair */
        if (!s->s) goto fail;
        t->n_stops++;
        unsigned char part[4];
        int have = 0, need = 0;
        for (size_t j = 0; j < n; j++)
            s->len +=
                (size_t)utf8_feed(part, &have, &need, (unsigned char)stops[i][j], s->s + s->len);
        if (need) {
            memcpy(s->s + s->len, REPLACEMENT, 3);
            s->len += 3;
        }
        s->fail = ds_malloc(s->len * sizeof *s->fail, err);
        if (!s->fail) goto fail;
        s->fail[0] = 0;
        for (size_t j = 1; j < s->len; j++) {
            size_t k = s->fail[j - 1];
            while (k > 0 && s->s[j] != s->s[k]) k = s->fail[k - 1];
            s->fail[j] = k + (s->s[j] == s->s[k]);
        }
    }
    return DS_OK;
fail:
    ds_textout_free(t);
    return DS_ERR;
}

/* Forgets the previous delta, which the caller has consumed by now. */
static void drop_emitted(ds_textout *t) {
    memmove(t->buf, t->buf + t->emitted, t->len - t->emitted);
    t->len -= t->emitted;
    t->emitted = 0;
}

/* Appends one byte of final text; returns 1 if it completed a stop string (the text is then cut
 * before that string and the choice is stopped). */
static int append_byte(ds_textout *t, char c) {
    t->buf[t->len++] = c;
    size_t hit = match_byte(t, c);
    if (!hit) return 0;
    t->len -= hit;
    t->stopped = 1;
    return 1;
}

int ds_textout_push(ds_textout *t, const char *bytes, size_t n, const char **delta,
                    size_t *delta_len, int *stopped) {
    drop_emitted(t);
    if (!t->stopped) {
        /* Room for the repaired bytes (at most 3 per byte, the pending partial included) plus a
         * U+FFFD that a later flush may add. */
        size_t want = t->len + 3 * (n + (size_t)t->have) + 3;
        if (want > t->cap) {
            size_t cap = DS_MAX(want, 2 * t->cap);
            char *b = realloc(t->buf, cap);
            if (!b) {
                *delta = t->buf;
                *delta_len = 0;
                *stopped = 0;
                return DS_ERR;
            }
            t->buf = b;
            t->cap = cap;
        }
        for (size_t i = 0; i < n && !t->stopped; i++) {
            char out[6];
            int m = utf8_feed(t->part, &t->have, &t->need, (unsigned char)bytes[i], out);
            for (int j = 0; j < m; j++)
                if (append_byte(t, out[j])) break;
        }
    }
    t->emitted = t->stopped ? t->len : t->len - held_tail(t);
    *delta = t->buf;
    *delta_len = t->emitted;
    *stopped = t->stopped;
    return DS_OK;
}

int ds_textout_flush(ds_textout *t, const char **delta, size_t *delta_len) {
    drop_emitted(t);
    int hit = 0;
    if (!t->stopped && t->need) /* push reserved room for these 3 bytes */
        for (int j = 0; j < 3 && !hit; j++) hit = append_byte(t, REPLACEMENT[j]);
    t->have = t->need = 0;
    for (int i = 0; i < t->n_stops; i++) t->stops[i].state = 0; /* nothing is held any more */
    t->emitted = t->len;
    *delta = t->buf;
    *delta_len = t->len;
    return hit;
}

void ds_textout_free(ds_textout *t) {
    for (int i = 0; i < t->n_stops; i++) {
        free(t->stops[i].s);
        free(t->stops[i].fail);
    }
    free(t->stops);
    free(t->buf);
    memset(t, 0, sizeof *t);
}
