/* safetensors_write.c — the safetensors writer (init-model's checkpoints): tensors are collected
 * in memory, then written as one file through a temporary file and a rename; see safetensors.h. */
#include "io/safetensors.h"
#include "io/strtab.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct wr_tensor {
    char *name;
    ds_dtype dtype;
    int ndim;
    int64_t shape[DS_MAX_DIMS];
    void *data; /* [nbytes] private copy */
    size_t nbytes;
} wr_tensor;

struct ds_st_writer {
    wr_tensor *t; /* [n] in insertion order (= header order) */
    int n, cap;
    ds_strtab by_name;
    char **meta; /* [2 * nmeta] key, value pairs in insertion order */
    int nmeta;
    size_t bytes; /* sum of nbytes */
};

static const char *wr_name_at(const void *ctx, int i) {
    return ((const ds_st_writer *)ctx)->t[i].name;
}

ds_st_writer *ds_st_writer_new(ds_err *err) {
    return ds_calloc(1, sizeof(ds_st_writer), err);
}

void ds_st_writer_free(ds_st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->n; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->t);
    for (int i = 0; i < 2 * w->nmeta; i++) free(w->meta[i]);
    free(w->meta);
    ds_strtab_free(&w->by_name);
    free(w);
}

size_t ds_st_writer_bytes(const ds_st_writer *w) {
    return w ? w->bytes : 0;
}

int ds_st_writer_add(ds_st_writer *w, const char *name, ds_dtype dtype, int ndim,
                     const int64_t *shape, const void *data, ds_err *err) {
    if (!w || !name || !*name) return ds_errf(err, "safetensors writer: empty tensor name");
    if (strcmp(name, "__metadata__") == 0)
        return ds_errf(err, "safetensors writer: '__metadata__' is reserved, not a tensor name");
    if ((unsigned)dtype >= DS_DT_COUNT)
        return ds_errf(err, "safetensors writer: tensor '%s': invalid dtype %d", name, (int)dtype);
    if (ndim < 0 || ndim > DS_MAX_DIMS)
        return ds_errf(err, "safetensors writer: tensor '%s': ndim %d outside [0, %d]", name, ndim,
                       DS_MAX_DIMS);
    uint64_t numel = 1, nbytes;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return ds_errf(err, "safetensors writer: tensor '%s': shape[%d] = %lld is negative",
                           name, i, (long long)shape[i]);
        if (__builtin_mul_overflow(numel, (uint64_t)shape[i], &numel))
            return ds_errf(err, "safetensors writer: tensor '%s': shape overflows", name);
    }
    if (__builtin_mul_overflow(numel, (uint64_t)ds_dtype_size(dtype), &nbytes) ||
        nbytes > (uint64_t)SIZE_MAX / 2)
        return ds_errf(err, "safetensors writer: tensor '%s': shape overflows", name);
    if (nbytes && !data)
        return ds_errf(err, "safetensors writer: tensor '%s': no data for %llu bytes", name,
                       (unsigned long long)nbytes);
    if (ds_strtab_find(&w->by_name, name, wr_name_at, w) >= 0)
        return ds_errf(err, "safetensors writer: tensor '%s' added twice", name);
    if (w->n == w->cap) {
        int ncap = w->cap ? w->cap * 2 : 32;
        wr_tensor *nt = realloc(w->t, (size_t)ncap * sizeof *nt);
        if (!nt) return ds_errf(err, "safetensors writer: out of memory");
        w->t = nt;
        w->cap = ncap;
    }
    wr_tensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    t->data = ds_malloc((size_t)nbytes, err);
    if (!t->name || !t->data) {
        free(t->name);
        free(t->data);
        return ds_errf(err, "safetensors writer: tensor '%s': out of memory (%llu bytes)", name,
                       (unsigned long long)nbytes);
    }
    if (nbytes) memcpy(t->data, data, (size_t)nbytes);
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->nbytes = (size_t)nbytes;
    if (ds_strtab_insert(&w->by_name, w->n, name, wr_name_at, w, err) == -2) {
        free(t->name);
        free(t->data);
        return DS_ERR;
    }
    w->n++;
    w->bytes += t->nbytes;
    return DS_OK;
}

int ds_st_writer_set_metadata(ds_st_writer *w, const char *key, const char *value, ds_err *err) {
    if (!w || !key || !value)
        return ds_errf(err, "safetensors writer: metadata needs a key and value");
    for (int i = 0; i < w->nmeta; i++)
        if (strcmp(w->meta[2 * i], key) == 0) {
            char *v = strdup(value);
            if (!v) return ds_errf(err, "safetensors writer: out of memory");
            free(w->meta[2 * i + 1]);
            w->meta[2 * i + 1] = v;
            return DS_OK;
        }
    char **nm = realloc(w->meta, (size_t)(w->nmeta + 1) * 2 * sizeof *nm);
    if (!nm) return ds_errf(err, "safetensors writer: out of memory");
    w->meta = nm;
    char *k = strdup(key), *v = strdup(value);
    if (!k || !v) {
        free(k);
        free(v);
        return ds_errf(err, "safetensors writer: out of memory");
    }
    w->meta[2 * w->nmeta] = k;
    w->meta[2 * w->nmeta + 1] = v;
    w->nmeta++;
    return DS_OK;
}

/* A JSON string literal; bytes >= 0x80 pass through (the name is expected to be UTF-8). */
static void sb_json_str(ds_sbuf *b, const char *s) {
    ds_sbuf_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char esc[2] = {'\\', (char)c};
            ds_sbuf_put(b, esc, 2);
        } else if (c < 0x20) {
            ds_sbuf_printf(b, "\\u%04x", c);
        } else {
            ds_sbuf_put(b, (const char *)&c, 1);
        }
    }
    ds_sbuf_put(b, "\"", 1);
}

/* Data order: larger elements first (stable), so that with the header padded to 8 bytes every
 * tensor starts at a multiple of its element size. No gaps: the Python safetensors reader
 * rejects holes between tensors. */
static int wr_order_cmp(const void *a, const void *b, void *ctx) {
    const ds_st_writer *w = ctx;
    int x = *(const int *)a, y = *(const int *)b;
    size_t sx = ds_dtype_size(w->t[x].dtype), sy = ds_dtype_size(w->t[y].dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return x - y;
}

static int write_all(int fd, const void *p, size_t n) {
    const uint8_t *q = p;
    while (n) {
        ssize_t k = write(fd, q, n > (1u << 30) ? (1u << 30) : n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        q += k;
        n -= (size_t)k;
    }
    return 0;
}

int ds_st_writer_write(ds_st_writer *w, const char *path, ds_err *err) {
    if (!w || !path) return ds_errf(err, "safetensors writer: no writer or path");
    int *order = ds_malloc((size_t)(w->n ? w->n : 1) * sizeof *order, err);    /* [n] data order */
    size_t *begin = ds_malloc((size_t)(w->n ? w->n : 1) * sizeof *begin, err); /* [n] offsets */
    if (!order || !begin) {
        free(order);
        free(begin);
        return ds_errf(err, "%s: out of memory", path);
    }
    for (int i = 0; i < w->n; i++) order[i] = i;
    qsort_r(order, (size_t)w->n, sizeof *order, wr_order_cmp, w);
    size_t off = 0;
    for (int i = 0; i < w->n; i++) {
        begin[order[i]] = off;
        off += w->t[order[i]].nbytes;
    }

    ds_sbuf h = {0};
    ds_sbuf_puts(&h, "{");
    int first = 1;
    if (w->nmeta) {
        ds_sbuf_puts(&h, "\"__metadata__\":{");
        for (int i = 0; i < w->nmeta; i++) {
            if (i) ds_sbuf_puts(&h, ",");
            sb_json_str(&h, w->meta[2 * i]);
            ds_sbuf_puts(&h, ":");
            sb_json_str(&h, w->meta[2 * i + 1]);
        }
        ds_sbuf_puts(&h, "}");
        first = 0;
    }
    for (int i = 0; i < w->n; i++) {
        const wr_tensor *t = &w->t[i];
        if (!first) ds_sbuf_puts(&h, ",");
        first = 0;
        sb_json_str(&h, t->name);
        ds_sbuf_puts(&h, ":{\"dtype\":\"");
        ds_sbuf_puts(&h, ds_dtype_name(t->dtype));
        ds_sbuf_puts(&h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++)
            ds_sbuf_printf(&h, d ? ",%lld" : "%lld", (long long)t->shape[d]);
        ds_sbuf_printf(&h, "],\"data_offsets\":[%lld", (long long)begin[i]);
        ds_sbuf_printf(&h, ",%lld]}", (long long)(begin[i] + t->nbytes));
    }
    ds_sbuf_puts(&h, "}");
    while (h.len % 8) ds_sbuf_puts(&h, " "); /* data section starts 8-aligned */
    free(begin);
    if (h.oom) {
        free(order);
        free(h.p);
        return ds_errf(err, "%s: out of memory building the header", path);
    }

    /* Temporary file in the same directory, so rename() is atomic and never crosses devices. */
    size_t tl = strlen(path) + 16;
    char *tmp = ds_malloc(tl, err);
    if (!tmp) {
        free(order);
        free(h.p);
        return DS_ERR;
    }
    snprintf(tmp, tl, "%s.tmp.XXXXXX", path);
    int rc = DS_OK;
    int fd = mkstemp(tmp);
    if (fd < 0) {
        rc = ds_errf(err, "%s: cannot create temporary file %s: %s", path, tmp, strerror(errno));
        goto out;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.len >> (8 * i));
    int bad = write_all(fd, len8, 8) || write_all(fd, h.p, h.len);
    for (int i = 0; !bad && i < w->n; i++)
        bad = write_all(fd, w->t[order[i]].data, w->t[order[i]].nbytes);
    if (!bad) bad = fchmod(fd, 0644) || fsync(fd);
    if (bad) {
        int e = errno;
        close(fd);
        unlink(tmp);
        rc = ds_errf(err, "%s: write failed: %s", path, strerror(e));
        goto out;
    }
    if (close(fd) != 0) {
        int e = errno;
        unlink(tmp);
        rc = ds_errf(err, "%s: write failed on close: %s", path, strerror(e));
        goto out;
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        rc = ds_errf(err, "%s: cannot rename %s into place: %s", path, tmp, strerror(e));
    }
out:
    free(tmp);
    free(order);
    free(h.p);
    return rc;
}
