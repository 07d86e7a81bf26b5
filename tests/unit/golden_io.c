/* golden_io.c — see golden_io.h. Parses the whole file from memory with a bounds-checked cursor. */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include "golden_io.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *name;
    int dtype;
    int ndim;
    uint64_t dims[DS_GOLDEN_MAX_NDIM];
    uint64_t numel;
    void *data;
} golden_entry;

struct ds_golden {
    int n;
    golden_entry *e;
};

static void seterr(char *buf, size_t len, const char *fmt, ...) {
    if (!buf || len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
}

static size_t dtype_size(int dt) {
    switch (dt) {
    case DS_GOLDEN_F32:
    case DS_GOLDEN_I32:
        return 4;
    case DS_GOLDEN_F64:
    case DS_GOLDEN_U64:
        return 8;
    default:
        return 0;
    }
}

/* Reads a whole file; returns a malloc'd buffer (at least 1 byte allocated) or NULL with errno set.
 */
static unsigned char *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        errno = ENOMEM;
        return NULL;
    }
    for (;;) {
        if (n == cap) {
            if (cap > SIZE_MAX / 2) {
                free(buf);
                fclose(f);
                errno = EFBIG;
                return NULL;
            }
            unsigned char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                fclose(f);
                errno = ENOMEM;
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        errno = EIO;
        return NULL;
    }
    *size = n;
    return buf;
}

typedef struct {
    const unsigned char *p;
    size_t left, off;
} cursor;

static int take(cursor *c, size_t n, const unsigned char **out) {
    if (n > c->left) return -1;
    *out = c->p;
    c->p += n;
    c->left -= n;
    c->off += n;
    return 0;
}

static uint64_t le(const unsigned char *b, int nbytes) {
    uint64_t v = 0;
    for (int i = nbytes - 1; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static int host_is_little_endian(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

void ds_golden_free(ds_golden *g) {
    if (!g) return;
    for (int i = 0; i < g->n; i++) {
        free(g->e[i].name);
        free(g->e[i].data);
    }
    free(g->e);
    free(g);
}

ds_golden *ds_golden_load(const char *path, char *errbuf, size_t errlen) {
    size_t size = 0;
    unsigned char *buf = read_all(path, &size);
    if (!buf) {
        seterr(errbuf, errlen, "golden %s: cannot read: %s", path, strerror(errno));
        return NULL;
    }
    ds_golden *g = calloc(1, sizeof *g);
    if (!g) {
        free(buf);
        seterr(errbuf, errlen, "golden %s: out of memory", path);
        return NULL;
    }
    cursor c = {buf, size, 0};
    const unsigned char *b;
    uint64_t n_entries;
    if (take(&c, 16, &b)) {
        seterr(errbuf, errlen, "golden %s: truncated header (%zu bytes, need 16)", path, size);
        goto fail;
    }
    if (memcmp(b, "DSGOLDEN", 8) != 0) {
        seterr(errbuf, errlen, "golden %s: bad magic (not a DSGOLDEN file)", path);
        goto fail;
    }
    if (le(b + 8, 4) != 1) {
        seterr(errbuf, errlen, "golden %s: version %u not supported (expected 1)", path,
               (unsigned)le(b + 8, 4));
        goto fail;
    }
    n_entries = le(b + 12, 4);
    /* smallest entry: u16 + 1 name byte + u8 + u8 = 5 bytes */
    if (n_entries > c.left / 5) {
        seterr(errbuf, errlen,
               "golden %s: n_entries %llu cannot fit in %zu remaining bytes (truncated?)", path,
               (unsigned long long)n_entries, c.left);
        goto fail;
    }
    g->e = calloc(n_entries ? (size_t)n_entries : 1, sizeof *g->e);
    if (!g->e) {
        seterr(errbuf, errlen, "golden %s: out of memory", path);
        goto fail;
    }
    for (uint64_t k = 0; k < n_entries; k++) {
        golden_entry *e = &g->e[k];
        size_t start = c.off;
        if (take(&c, 2, &b)) {
            seterr(errbuf, errlen, "golden %s: truncated at byte %zu (entry %llu name length)",
                   path, start, (unsigned long long)k);
            goto fail;
        }
        size_t nl = (size_t)le(b, 2);
        if (nl == 0) {
            seterr(errbuf, errlen, "golden %s: entry %llu at byte %zu has an empty name", path,
                   (unsigned long long)k, start);
            goto fail;
        }
        if (take(&c, nl, &b)) {
            seterr(errbuf, errlen, "golden %s: truncated at byte %zu (entry %llu name, %zu bytes)",
                   path, c.off, (unsigned long long)k, nl);
            goto fail;
        }
        if (memchr(b, 0, nl)) {
            seterr(errbuf, errlen, "golden %s: entry %llu name contains a NUL byte", path,
                   (unsigned long long)k);
            goto fail;
        }
        e->name = malloc(nl + 1);
        if (!e->name) {
            seterr(errbuf, errlen, "golden %s: out of memory", path);
            goto fail;
        }
        memcpy(e->name, b, nl);
        e->name[nl] = '\0';
        g->n = (int)k + 1; /* from here on e->name is owned by g */
        for (uint64_t j = 0; j < k; j++) {
            if (strcmp(g->e[j].name, e->name) == 0) {
                seterr(errbuf, errlen, "golden %s: duplicate entry '%s'", path, e->name);
                goto fail;
            }
        }
        if (take(&c, 2, &b)) {
            seterr(errbuf, errlen, "golden %s: truncated at byte %zu (entry '%s' dtype/ndim)", path,
                   c.off, e->name);
            goto fail;
        }
        e->dtype = b[0];
        e->ndim = b[1];
        size_t esz = dtype_size(e->dtype);
        if (esz == 0) {
            seterr(errbuf, errlen, "golden %s: entry '%s' has unknown dtype %d", path, e->name,
                   e->dtype);
            goto fail;
        }
        if (e->ndim > DS_GOLDEN_MAX_NDIM) {
            seterr(errbuf, errlen, "golden %s: entry '%s' has ndim %d > %d", path, e->name, e->ndim,
                   DS_GOLDEN_MAX_NDIM);
            goto fail;
        }
        if (take(&c, (size_t)e->ndim * 8, &b)) {
            seterr(errbuf, errlen, "golden %s: truncated at byte %zu (entry '%s' dims)", path,
                   c.off, e->name);
            goto fail;
        }
        uint64_t numel = 1;
        for (int d = 0; d < e->ndim; d++) {
            e->dims[d] = le(b + 8 * d, 8);
            if (e->dims[d] != 0 && numel > UINT64_MAX / e->dims[d]) {
                seterr(errbuf, errlen, "golden %s: entry '%s' dims overflow", path, e->name);
                goto fail;
            }
            numel *= e->dims[d];
        }
        e->numel = numel;
        if (numel > (uint64_t)(SIZE_MAX / esz) || numel * esz > (uint64_t)c.left) {
            seterr(errbuf, errlen,
                   "golden %s: truncated: entry '%s' needs %llu bytes of data at byte %zu, only "
                   "%zu left",
                   path, e->name, (unsigned long long)numel * (unsigned long long)esz, c.off,
                   c.left);
            goto fail;
        }
        size_t nbytes = (size_t)numel * esz;
        take(&c, nbytes, &b);
        e->data = malloc(nbytes ? nbytes : 1);
        if (!e->data) {
            seterr(errbuf, errlen, "golden %s: out of memory (%zu bytes for '%s')", path, nbytes,
                   e->name);
            goto fail;
        }
        if (nbytes) memcpy(e->data, b, nbytes);
        if (!host_is_little_endian()) {
            unsigned char *q = e->data;
            for (size_t i = 0; i < nbytes; i += esz)
                for (size_t a = 0, z = esz - 1; a < z; a++, z--) {
                    unsigned char t = q[i + a];
                    q[i + a] = q[i + z];
                    q[i + z] = t;
                }
        }
    }
    if (c.left != 0) {
        seterr(errbuf, errlen, "golden %s: %zu trailing bytes after the last entry", path, c.left);
        goto fail;
    }
    free(buf);
    return g;
fail:
    free(buf);
    ds_golden_free(g);
    return NULL;
}

static const golden_entry *find(const ds_golden *g, const char *name) {
    if (!g || !name) return NULL;
    for (int i = 0; i < g->n; i++)
        if (strcmp(g->e[i].name, name) == 0) return &g->e[i];
    return NULL;
}

const void *ds_golden_get(const ds_golden *g, const char *name, int dtype, int *ndim,
                          const uint64_t **dims) {
    const golden_entry *e = find(g, name);
    if (!e || e->dtype != dtype) return NULL;
    if (ndim) *ndim = e->ndim;
    if (dims) *dims = e->dims;
    return e->data;
}

uint64_t ds_golden_numel(const ds_golden *g, const char *name) {
    const golden_entry *e = find(g, name);
    return e ? e->numel : 0;
}

int ds_golden_count(const ds_golden *g) {
    return g ? g->n : 0;
}

const char *ds_golden_name(const ds_golden *g, int i) {
    return (g && i >= 0 && i < g->n) ? g->e[i].name : NULL;
}

uint64_t ds_fnv1a64_update(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= UINT64_C(0x100000001b3);
    }
    return h;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int ds_golden_checkpoint_fnv1a64(const char *dir, uint64_t *out, char *errbuf, size_t errlen) {
    if (errbuf && errlen) errbuf[0] = '\0';
    DIR *d = opendir(dir);
    if (!d) {
        seterr(errbuf, errlen, "checkpoint %s: cannot open directory: %s", dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = -1;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        size_t l = strlen(de->d_name);
        const char *suf = ".safetensors";
        size_t sl = strlen(suf);
        if (l <= sl || strcmp(de->d_name + l - sl, suf) != 0) continue;
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 16;
            char **nn = realloc(names, nc * sizeof *nn);
            if (!nn) goto done;
            names = nn;
            cap = nc;
        }
        names[n] = malloc(l + 1);
        if (!names[n]) goto done;
        memcpy(names[n], de->d_name, l + 1);
        n++;
    }
    if (n == 0) {
        seterr(errbuf, errlen, "checkpoint %s: no *.safetensors files", dir);
        goto done;
    }
    qsort(names, n, sizeof *names, cmp_str);
    uint64_t h = DS_FNV1A64_INIT;
    size_t bufsz = 1 << 20;
    unsigned char *buf = malloc(bufsz);
    if (!buf) goto done;
    for (size_t i = 0; i < n; i++) {
        size_t pl = strlen(dir) + strlen(names[i]) + 2;
        char *path = malloc(pl);
        if (!path) {
            free(buf);
            goto done;
        }
        snprintf(path, pl, "%s/%s", dir, names[i]);
        FILE *f = fopen(path, "rb");
        if (!f) {
            seterr(errbuf, errlen, "checkpoint %s: cannot open %s: %s", dir, names[i],
                   strerror(errno));
            free(path);
            free(buf);
            goto done;
        }
        size_t got;
        while ((got = fread(buf, 1, bufsz, f)) > 0) h = ds_fnv1a64_update(h, buf, got);
        int bad = ferror(f);
        fclose(f);
        free(path);
        if (bad) {
            seterr(errbuf, errlen, "checkpoint %s: read error in %s", dir, names[i]);
            free(buf);
            goto done;
        }
    }
    free(buf);
    *out = h;
    rc = 0;
done:
    if (rc != 0 && errbuf && errlen && errbuf[0] == '\0')
        seterr(errbuf, errlen, "checkpoint %s: out of memory", dir);
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    closedir(d);
    return rc;
}
