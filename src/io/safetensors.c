/* safetensors.c — mmap-backed safetensors reader (one file or an index-named shard set) and a
 * writer.
 *
 * File layout: u64 little-endian N | N bytes of JSON header | data section. The header maps each
 * tensor name to {"dtype", "shape", "data_offsets": [begin, end]} with offsets relative to the
 * data section, plus an optional "__metadata__" object of string -> string.
 *
 * The reader trusts nothing in the file: every size is checked with overflow-safe arithmetic
 * before a pointer into the mapping is formed, so a malformed or hostile file gives an error
 * message, never an out-of-bounds read. Tensors are found by name through an open-addressing hash
 * table (a checkpoint can hold ~100k tensors). */
#include "io/safetensors.h"
#include "io/jsonutil.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * dtypes */

static const char *const dtype_names[DS_DT_COUNT] = {"F32", "F16", "BF16", "U8",
                                                     "I8",  "I32", "I64",  "F64"};
static const size_t dtype_sizes[DS_DT_COUNT] = {4, 2, 2, 1, 1, 4, 8, 8};

const char *ds_dtype_name(ds_dtype dt) {
    return (unsigned)dt < DS_DT_COUNT ? dtype_names[dt] : "?";
}

size_t ds_dtype_size(ds_dtype dt) {
    return (unsigned)dt < DS_DT_COUNT ? dtype_sizes[dt] : 0;
}

static int dtype_from_name(const char *s, ds_dtype *out) {
    for (int i = 0; i < DS_DT_COUNT; i++)
        if (strcmp(s, dtype_names[i]) == 0) {
            *out = (ds_dtype)i;
            return DS_OK;
        }
    return DS_ERR;
}

/* ---------------------------------------------------------------------------------------------
 * String hash table: maps a name to an index into its owner's array. The owner supplies the
 * names through name_at(), so the table stores only indices. */

typedef const char *(*name_at_fn)(const void *ctx, int i);

typedef struct strtab {
    int *slot;  /* [cap] index + 1 into the owner's array; 0 = empty */
    size_t cap; /* power of two, kept >= 2 x n so probes stay short */
    int n;
} strtab;

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a, then a final mix for the low bits */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static int strtab_find(const strtab *t, const char *key, name_at_fn name_at, const void *ctx) {
    if (!t->cap) return -1;
    for (size_t i = hash_str(key) & (t->cap - 1);; i = (i + 1) & (t->cap - 1)) {
        int s = t->slot[i];
        if (!s) return -1;
        if (strcmp(name_at(ctx, s - 1), key) == 0) return s - 1;
    }
}

static void strtab_put_slot(strtab *t, int idx, const char *key) {
    size_t i = hash_str(key) & (t->cap - 1);
    while (t->slot[i]) i = (i + 1) & (t->cap - 1);
    t->slot[i] = idx + 1;
}

/* Inserts idx under key. Returns -1 when inserted, the existing index when key is already there,
 * -2 when out of memory. */
static int strtab_insert(strtab *t, int idx, const char *key, name_at_fn name_at, const void *ctx,
                         ds_err *err) {
    int found = strtab_find(t, key, name_at, ctx);
    if (found >= 0) return found;
    if ((size_t)(t->n + 1) * 2 > t->cap) {
        size_t ncap = t->cap ? t->cap * 2 : 64;
        int *ns = ds_calloc(ncap, sizeof *ns, err);
        if (!ns) return -2;
        int *old = t->slot;
        size_t ocap = t->cap;
        t->slot = ns;
        t->cap = ncap;
        for (size_t i = 0; i < ocap; i++)
            if (old[i]) strtab_put_slot(t, old[i] - 1, name_at(ctx, old[i] - 1));
        free(old);
    }
    strtab_put_slot(t, idx, key);
    t->n++;
    return -1;
}

static void strtab_free(strtab *t) {
    free(t->slot);
    memset(t, 0, sizeof *t);
}

/* ---------------------------------------------------------------------------------------------
 * Reader */

typedef struct st_file {
    char *path;
    uint8_t *map; /* [size] whole file, PROT_READ, MAP_PRIVATE */
    size_t size;
    json_t *meta; /* the "__metadata__" object, or NULL */
} st_file;

struct ds_st {
    char *path;     /* what was opened (file or index); names errors about absent tensors */
    st_file *files; /* [nfiles] */
    int nfiles, files_cap;
    ds_tensor *tensors; /* [count] in file order, then header order */
    int count, cap;
    strtab by_name;
};

static const char *tensor_name_at(const void *ctx, int i) {
    return ((const ds_st *)ctx)->tensors[i].name;
}

static int push_tensor(ds_st *st, ds_tensor **out, ds_err *err) {
    if (st->count == st->cap) {
        int ncap = st->cap ? st->cap * 2 : 64;
        ds_tensor *nt = realloc(st->tensors, (size_t)ncap * sizeof *nt);
        if (!nt) return ds_errf(err, "out of memory growing the tensor table to %d", ncap);
        st->tensors = nt;
        st->cap = ncap;
    }
    *out = &st->tensors[st->count++];
    memset(*out, 0, sizeof **out);
    return DS_OK;
}

/* Parses one header entry (name -> {dtype, shape, data_offsets}) into t, checking it against
 * the data section [0, data_len). */
static int parse_entry(const char *path, const char *name, const json_t *e, const uint8_t *data,
                       size_t data_len, ds_tensor *t, ds_err *err) {
    if (!json_is_object(e))
        return ds_errf(err, "%s: tensor '%s': header entry must be an object, found %s", path, name,
                       ds_json_type_name(e));
    const json_t *jd = json_object_get(e, "dtype"), *js = json_object_get(e, "shape"),
                 *jo = json_object_get(e, "data_offsets");
    if (!jd) return ds_errf(err, "%s: tensor '%s': header entry has no 'dtype'", path, name);
    if (!js) return ds_errf(err, "%s: tensor '%s': header entry has no 'shape'", path, name);
    if (!jo) return ds_errf(err, "%s: tensor '%s': header entry has no 'data_offsets'", path, name);
    if (!json_is_string(jd))
        return ds_errf(err, "%s: tensor '%s': 'dtype' must be a string, found %s", path, name,
                       ds_json_type_name(jd));
    if (dtype_from_name(json_string_value(jd), &t->dtype) != DS_OK)
        return ds_errf(err,
                       "%s: tensor '%s': unsupported dtype \"%s\" (expected one of F32, F16, "
                       "BF16, U8, I8, I32, I64, F64)",
                       path, name, json_string_value(jd));
    if (!json_is_array(js))
        return ds_errf(err, "%s: tensor '%s': 'shape' must be an array, found %s", path, name,
                       ds_json_type_name(js));
    size_t nd = json_array_size(js);
    if (nd > DS_MAX_DIMS)
        return ds_errf(err, "%s: tensor '%s': %zu dimensions, at most %d supported", path, name, nd,
                       DS_MAX_DIMS);
    t->ndim = (int)nd;
    /* numel x element size must fit in size_t and, below, in the data section. */
    uint64_t numel = 1;
    for (size_t i = 0; i < nd; i++) {
        const json_t *d = json_array_get(js, i);
        if (!json_is_integer(d))
            return ds_errf(err, "%s: tensor '%s': shape[%zu] must be an integer, found %s", path,
                           name, i, ds_json_type_name(d));
        json_int_t v = json_integer_value(d);
        if (v < 0)
            return ds_errf(err, "%s: tensor '%s': shape[%zu] = %lld is negative", path, name, i,
                           (long long)v);
        t->shape[i] = v;
        if (__builtin_mul_overflow(numel, (uint64_t)v, &numel) || numel > (uint64_t)INT64_MAX)
            return ds_errf(err, "%s: tensor '%s': shape overflows the element count", path, name);
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, (uint64_t)ds_dtype_size(t->dtype), &nbytes) ||
        nbytes > (uint64_t)SIZE_MAX)
        return ds_errf(err, "%s: tensor '%s': shape overflows the byte count", path, name);
    t->numel = (int64_t)numel;
    t->nbytes = (size_t)nbytes;

    if (!json_is_array(jo) || json_array_size(jo) != 2 || !json_is_integer(json_array_get(jo, 0)) ||
        !json_is_integer(json_array_get(jo, 1)))
        return ds_errf(err, "%s: tensor '%s': 'data_offsets' must be [begin, end] integers", path,
                       name);
    json_int_t b = json_integer_value(json_array_get(jo, 0));
    json_int_t e2 = json_integer_value(json_array_get(jo, 1));
    if (b < 0 || e2 < b)
        return ds_errf(err, "%s: tensor '%s': data_offsets [%lld, %lld] are not 0 <= begin <= end",
                       path, name, (long long)b, (long long)e2);
    if ((uint64_t)(e2 - b) != nbytes)
        return ds_errf(err,
                       "%s: tensor '%s': header lies about size: data_offsets [%lld, %lld] span "
                       "%lld bytes but dtype %s x %llu elements needs %llu",
                       path, name, (long long)b, (long long)e2, (long long)(e2 - b),
                       ds_dtype_name(t->dtype), (unsigned long long)numel,
                       (unsigned long long)nbytes);
    if ((uint64_t)e2 > data_len)
        return ds_errf(err,
                       "%s: tensor '%s': data_offsets end %lld is beyond the data section (%zu "
                       "bytes); the file is truncated",
                       path, name, (long long)e2, data_len);
    t->data = data + b;
    return DS_OK;
}

typedef struct span {
    size_t begin, end;
    int idx;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->idx - y->idx;
}

/* Tensors [first, first+n) of one file must not share bytes. Empty tensors own no bytes. */
static int check_overlaps(const ds_st *st, const char *path, int first, int n, const uint8_t *base,
                          ds_err *err) {
    if (n < 2) return DS_OK;
    span *sp = ds_malloc((size_t)n * sizeof *sp, err); /* [n] */
    if (!sp) return DS_ERR;
    for (int i = 0; i < n; i++) {
        const ds_tensor *t = &st->tensors[first + i];
        sp[i].begin = (size_t)((const uint8_t *)t->data - base);
        sp[i].end = sp[i].begin + t->nbytes;
        sp[i].idx = first + i;
    }
    qsort(sp, (size_t)n, sizeof *sp, span_cmp);
    int rc = DS_OK, owner = -1; /* owner: the tensor reaching furthest so far */
    size_t reach = 0;
    for (int i = 0; i < n; i++) {
        if (sp[i].end == sp[i].begin) continue;
        if (owner >= 0 && sp[i].begin < reach) {
            const ds_tensor *a = &st->tensors[owner], *b = &st->tensors[sp[i].idx];
            size_t ab = (size_t)((const uint8_t *)a->data - base);
            rc = ds_errf(err, "%s: tensors '%s' [%zu, %zu) and '%s' [%zu, %zu) overlap", path,
                         a->name, ab, ab + a->nbytes, b->name, sp[i].begin, sp[i].end);
            break;
        }
        if (sp[i].end > reach) {
            reach = sp[i].end;
            owner = sp[i].idx;
        }
    }
    free(sp);
    return rc;
}

/* Maps `path`, validates its header and appends its tensors to st. */
static int load_file(ds_st *st, const char *path, ds_err *err) {
    if (st->nfiles == st->files_cap) {
        int ncap = st->files_cap ? st->files_cap * 2 : 4;
        st_file *nf = realloc(st->files, (size_t)ncap * sizeof *nf);
        if (!nf) return ds_errf(err, "%s: out of memory", path);
        st->files = nf;
        st->files_cap = ncap;
    }
    st_file *f = &st->files[st->nfiles];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return ds_errf(err, "%s: out of memory", path);
    st->nfiles++; /* from here on ds_st_close releases whatever f holds */

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ds_errf(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return ds_errf(err, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return ds_errf(err, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return ds_errf(err,
                       "%s: file is %lld bytes, shorter than the 8-byte header length; not a "
                       "safetensors file",
                       path, (long long)sb.st_size);
    }
    f->size = (size_t)sb.st_size;
    void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (m == MAP_FAILED) {
        ds_errf(err, "%s: cannot mmap %zu bytes: %s", path, f->size, strerror(e));
        f->size = 0;
        return DS_ERR;
    }
    f->map = m;

    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->map[i];
    if (hlen > f->size - 8)
        return ds_errf(err,
                       "%s: header length %llu is larger than the rest of the file (%zu bytes); "
                       "truncated or not a safetensors file",
                       path, (unsigned long long)hlen, f->size - 8);
    json_error_t je;
    /* REJECT_DUPLICATES: a name given twice would otherwise silently keep the last entry. */
    json_t *root = json_loadb((const char *)f->map + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (strstr(je.text, "duplicate object key"))
            return ds_errf(err, "%s: duplicate tensor name in header: %s", path, je.text);
        return ds_errf(err, "%s: header is not valid JSON (line %d, column %d): %s", path, je.line,
                       je.column, je.text);
    }
    if (!json_is_object(root)) {
        ds_errf(err, "%s: header must be a JSON object, found %s", path, ds_json_type_name(root));
        json_decref(root);
        return DS_ERR;
    }

    const uint8_t *data = f->map + 8 + hlen;
    size_t data_len = f->size - 8 - (size_t)hlen;
    int first = st->count, rc = DS_OK;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(val)) {
                rc = ds_errf(err, "%s: '__metadata__' must be an object, found %s", path,
                             ds_json_type_name(val));
                break;
            }
            const char *mk;
            json_t *mv;
            json_object_foreach(val, mk, mv) {
                if (!json_is_string(mv)) {
                    rc = ds_errf(err, "%s: '__metadata__' key '%s' must map to a string, found %s",
                                 path, mk, ds_json_type_name(mv));
                    break;
                }
            }
            if (rc != DS_OK) break;
            f->meta = json_incref(val);
            continue;
        }
        if (!*key) { /* no loader could ask for it, and the writer refuses to write one */
            rc = ds_errf(err, "%s: a tensor with an empty name", path);
            break;
        }
        ds_tensor *t = NULL;
        if ((rc = push_tensor(st, &t, err)) != DS_OK) break;
        t->name = strdup(key);
        if (!t->name) {
            rc = ds_errf(err, "%s: out of memory", path);
            break;
        }
        t->file = f->path;
        if ((rc = parse_entry(path, key, val, data, data_len, t, err)) != DS_OK) break;
    }
    json_decref(root);
    if (rc != DS_OK) return rc;
    return check_overlaps(st, path, first, st->count - first, data, err);
}

/* Builds the name index over every tensor; a name in two files is an error. */
static int build_index(ds_st *st, ds_err *err) {
    for (int i = 0; i < st->count; i++) {
        int prev = strtab_insert(&st->by_name, i, st->tensors[i].name, tensor_name_at, st, err);
        if (prev == -2) return DS_ERR;
        if (prev >= 0)
            return ds_errf(err, "%s: tensor '%s' appears twice: in '%s' and in '%s'", st->path,
                           st->tensors[i].name, st->tensors[prev].file, st->tensors[i].file);
    }
    return DS_OK;
}

static ds_st *st_new(const char *path, ds_err *err) {
    ds_st *st = ds_calloc(1, sizeof *st, err);
    if (!st) return NULL;
    st->path = strdup(path);
    if (!st->path) {
        free(st);
        ds_errf(err, "%s: out of memory", path);
        return NULL;
    }
    return st;
}

int ds_st_open_file(const char *path, ds_st **out, ds_err *err) {
    *out = NULL;
    ds_st *st = st_new(path, err);
    if (!st) return DS_ERR;
    if (load_file(st, path, err) != DS_OK || build_index(st, err) != DS_OK) {
        ds_st_close(st);
        return DS_ERR;
    }
    *out = st;
    return DS_OK;
}

static char *path_join(const char *dir, const char *name, ds_err *err) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = ds_malloc(n, err);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* Shard names come from the index; keep them inside the checkpoint directory. */
static int shard_name_ok(const char *s) {
    if (!*s || s[0] == '/') return 0;
    for (const char *p = s; *p;) {
        const char *q = strchr(p, '/');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') return 0;
        if (!q) break;
        p = q + 1;
    }
    return 1;
}

typedef struct shard_list {
    const char **names; /* [n] distinct shard file names, in order of first mention */
    int n, cap;
} shard_list;

static const char *shard_name_at(const void *ctx, int i) {
    return ((const shard_list *)ctx)->names[i];
}

static int open_index(ds_st *st, const char *dir, const char *index_path, ds_err *err) {
    size_t len;
    char *text = ds_read_file(index_path, &len, err);
    if (!text) return DS_ERR;
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    free(text);
    if (!root)
        return ds_errf(err, "%s: not valid JSON (line %d, column %d): %s", index_path, je.line,
                       je.column, je.text);
    int rc = DS_OK;
    shard_list sl = {0};
    strtab shard_tab = {0};
    json_t *wm = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!wm || !json_is_object(wm)) {
        rc = ds_errf(err, "%s: missing required key 'weight_map' (an object of tensor -> file)",
                     index_path);
        goto done;
    }
    if (json_object_size(wm) == 0) {
        rc = ds_errf(err, "%s: 'weight_map' is empty", index_path);
        goto done;
    }
    const char *tname;
    json_t *fv;
    json_object_foreach(wm, tname, fv) {
        if (!json_is_string(fv)) {
            rc = ds_errf(err, "%s: weight_map['%s'] must be a file name string, found %s",
                         index_path, tname, ds_json_type_name(fv));
            goto done;
        }
        const char *fname = json_string_value(fv);
        if (!shard_name_ok(fname)) {
            rc = ds_errf(err, "%s: weight_map['%s'] = '%s' is not a file inside the checkpoint",
                         index_path, tname, fname);
            goto done;
        }
        if (sl.n == sl.cap) {
            int ncap = sl.cap ? sl.cap * 2 : 16;
            const char **nn = realloc(sl.names, (size_t)ncap * sizeof *nn);
            if (!nn) {
                rc = ds_errf(err, "%s: out of memory", index_path);
                goto done;
            }
            sl.names = nn;
            sl.cap = ncap;
        }
        sl.names[sl.n] = fname;
        int prev = strtab_insert(&shard_tab, sl.n, fname, shard_name_at, &sl, err);
        if (prev == -2) {
            rc = DS_ERR;
            goto done;
        }
        if (prev == -1) sl.n++;
    }
    /* Open each distinct shard once. */
    for (int i = 0; i < sl.n; i++) {
        char *p = path_join(dir, sl.names[i], err);
        if (!p) {
            rc = DS_ERR;
            goto done;
        }
        rc = load_file(st, p, err);
        free(p);
        if (rc != DS_OK) {
            ds_err_prefix(err, "%s: shard '%s'", index_path, sl.names[i]);
            goto done;
        }
    }
    if ((rc = build_index(st, err)) != DS_OK) goto done;
    /* The index must describe the shards truthfully. Shard i is file i (opened in order). */
    json_object_foreach(wm, tname, fv) {
        const char *fname = json_string_value(fv);
        int si = strtab_find(&shard_tab, fname, shard_name_at, &sl);
        const ds_tensor *t = ds_st_find(st, tname);
        if (!t) {
            rc = ds_errf(err, "%s: tensor '%s' is mapped to '%s' but that shard does not hold it",
                         index_path, tname, fname);
            goto done;
        }
        if (t->file != st->files[si].path) {
            rc = ds_errf(err, "%s: tensor '%s' is mapped to '%s' but lives in '%s'", index_path,
                         tname, fname, t->file);
            goto done;
        }
    }
done:
    free(sl.names);
    strtab_free(&shard_tab);
    json_decref(root);
    return rc;
}

static int file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

int ds_st_open_dir(const char *dir, ds_st **out, ds_err *err) {
    *out = NULL;
    char *index = path_join(dir, "model.safetensors.index.json", err);
    if (!index) return DS_ERR;
    if (file_exists(index)) {
        ds_st *st = st_new(index, err);
        int rc = st ? open_index(st, dir, index, err) : DS_ERR;
        free(index);
        if (rc != DS_OK) {
            ds_st_close(st);
            return DS_ERR;
        }
        *out = st;
        return DS_OK;
    }
    free(index);
    char *single = path_join(dir, "model.safetensors", err);
    if (!single) return DS_ERR;
    if (file_exists(single)) {
        int rc = ds_st_open_file(single, out, err);
        free(single);
        return rc;
    }
    free(single);
    /* Fall back to the one *.safetensors file in dir (e.g. a draft checkpoint's only file). */
    DIR *d = opendir(dir);
    if (!d) return ds_errf(err, "%s: cannot open directory: %s", dir, strerror(errno));
    char *found = NULL;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!ends_with(de->d_name, ".safetensors")) continue;
        if (n++ == 0) found = strdup(de->d_name);
    }
    closedir(d);
    if (n != 1) {
        free(found);
        if (n == 0)
            return ds_errf(err,
                           "%s: no model.safetensors.index.json, model.safetensors or other "
                           "*.safetensors file",
                           dir);
        return ds_errf(err,
                       "%s: %d *.safetensors files but no model.safetensors.index.json to say "
                       "which tensor is where",
                       dir, n);
    }
    if (!found) return ds_errf(err, "%s: out of memory", dir);
    char *p = path_join(dir, found, err);
    free(found);
    if (!p) return DS_ERR;
    int rc = ds_st_open_file(p, out, err);
    free(p);
    return rc;
}

void ds_st_close(ds_st *st) {
    if (!st) return;
    for (int i = 0; i < st->count; i++) free((char *)st->tensors[i].name);
    free(st->tensors);
    for (int i = 0; i < st->nfiles; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
        json_decref(st->files[i].meta);
        free(st->files[i].path);
    }
    free(st->files);
    strtab_free(&st->by_name);
    free(st->path);
    free(st);
}

int ds_st_count(const ds_st *st) {
    return st ? st->count : 0;
}

const ds_tensor *ds_st_at(const ds_st *st, int i) {
    return st && i >= 0 && i < st->count ? &st->tensors[i] : NULL;
}

const ds_tensor *ds_st_find(const ds_st *st, const char *name) {
    if (!st || !name) return NULL;
    int i = strtab_find(&st->by_name, name, tensor_name_at, st);
    return i >= 0 ? &st->tensors[i] : NULL;
}

const char *ds_st_metadata(const ds_st *st, const char *key) {
    if (!st || !key) return NULL;
    for (int i = 0; i < st->nfiles; i++) {
        const json_t *v = st->files[i].meta ? json_object_get(st->files[i].meta, key) : NULL;
        if (v) return json_string_value(v);
    }
    return NULL;
}

/* "[4096, 2304]"; negative (wildcard) dims print as "?". */
static void fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t off = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && off < n; i++) {
        if (shape[i] < 0)
            off += (size_t)snprintf(buf + off, n - off, "%s?", i ? ", " : "");
        else
            off +=
                (size_t)snprintf(buf + off, n - off, "%s%lld", i ? ", " : "", (long long)shape[i]);
    }
    if (off < n) snprintf(buf + off, n - off, "]");
}

static void fmt_mask(char *buf, size_t n, unsigned mask) {
    size_t off = 0;
    buf[0] = 0;
    for (int i = 0; i < DS_DT_COUNT && off < n; i++)
        if (mask & (1u << i))
            off += (size_t)snprintf(buf + off, n - off, "%s%s", off ? "|" : "", dtype_names[i]);
    if (!off) snprintf(buf, n, "(none)");
}

int ds_st_get(const ds_st *st, const char *name, unsigned dtype_mask, int ndim,
              const int64_t *shape, const ds_tensor **out, ds_err *err) {
    if (out) *out = NULL;
    const ds_tensor *t = ds_st_find(st, name);
    if (!t) return ds_errf(err, "%s: tensor '%s' not found", st ? st->path : "(null)", name);
    int ok = (dtype_mask & (1u << t->dtype)) && t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        if (shape[i] >= 0 && shape[i] != t->shape[i]) ok = 0;
    if (!ok) {
        char es[256], fs[256], em[64];
        fmt_shape(es, sizeof es, ndim, shape);
        fmt_shape(fs, sizeof fs, t->ndim, t->shape);
        fmt_mask(em, sizeof em, dtype_mask);
        return ds_errf(err, "%s: tensor '%s': expected shape %s dtype %s, found shape %s dtype %s",
                       t->file, t->name, es, em, fs, ds_dtype_name(t->dtype));
    }
    if (out) *out = t;
    return DS_OK;
}

int ds_tensor_to_f32(const ds_tensor *t, float *dst, ds_err *err) {
    if (!t) return ds_errf(err, "ds_tensor_to_f32: no tensor");
    /* The data may sit at any byte offset in the mapping, so read through memcpy. */
    const uint8_t *src = t->data;
    int64_t n = t->numel;
    switch (t->dtype) {
    case DS_DT_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case DS_DT_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = ds_bf16_to_f32(h);
        }
        break;
    case DS_DT_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = ds_f16_to_f32(h);
        }
        break;
    case DS_DT_F64:
        for (int64_t i = 0; i < n; i++) {
            double v;
            memcpy(&v, src + 8 * i, 8);
            dst[i] = (float)v;
        }
        break;
    default:
        return ds_errf(err, "%s: tensor '%s': dtype %s is not a float type", t->file, t->name,
                       ds_dtype_name(t->dtype));
    }
    return DS_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Writer */

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
    strtab by_name;
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
    strtab_free(&w->by_name);
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
    if (strtab_find(&w->by_name, name, wr_name_at, w) >= 0)
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
    if (strtab_insert(&w->by_name, w->n, name, wr_name_at, w, err) == -2) {
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

/* A growable byte buffer for the header text. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t ncap = (b->len + n + 1) * 2;
        char *np = realloc(b->p, ncap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_str(sbuf *b, const char *s) {
    sb_put(b, s, strlen(s));
}

static void sb_fmt(sbuf *b, const char *fmt, long long v) {
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, fmt, v);
    sb_put(b, tmp, (size_t)n);
}

/* A JSON string literal; bytes >= 0x80 pass through (the name is expected to be UTF-8). */
static void sb_json_str(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char esc[2] = {'\\', (char)c};
            sb_put(b, esc, 2);
        } else if (c < 0x20) {
            sb_fmt(b, "\\u%04llx", c);
        } else {
            sb_put(b, (const char *)&c, 1);
        }
    }
    sb_put(b, "\"", 1);
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

    sbuf h = {0};
    sb_str(&h, "{");
    int first = 1;
    if (w->nmeta) {
        sb_str(&h, "\"__metadata__\":{");
        for (int i = 0; i < w->nmeta; i++) {
            if (i) sb_str(&h, ",");
            sb_json_str(&h, w->meta[2 * i]);
            sb_str(&h, ":");
            sb_json_str(&h, w->meta[2 * i + 1]);
        }
        sb_str(&h, "}");
        first = 0;
    }
    for (int i = 0; i < w->n; i++) {
        const wr_tensor *t = &w->t[i];
        if (!first) sb_str(&h, ",");
        first = 0;
        sb_json_str(&h, t->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, ds_dtype_name(t->dtype));
        sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) sb_fmt(&h, d ? ",%lld" : "%lld", (long long)t->shape[d]);
        sb_fmt(&h, "],\"data_offsets\":[%lld", (long long)begin[i]);
        sb_fmt(&h, ",%lld]}", (long long)(begin[i] + t->nbytes));
    }
    sb_str(&h, "}");
    while (h.len % 8) sb_str(&h, " "); /* data section starts 8-aligned */
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
