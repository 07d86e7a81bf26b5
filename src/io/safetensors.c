/* safetensors.c — the mmap-backed safetensors reader (one file or an index-named shard set), the
 * dtypes, and the conversion of float tensors to f32; the writer is in safetensors_write.c.
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
#include "io/strtab.h"

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

static const char *const dtype_names[DS_DT_COUNT] = {"F32", "F16", "BF16", "U8",     "I8",
                                                     "I32", "I64", "F64",  "F8_E4M3"};
static const size_t dtype_sizes[DS_DT_COUNT] = {4, 2, 2, 1, 1, 4, 8, 8, 1};

const char *ds_dtype_name(ds_dtype dt) {
    if (dt == DS_DT_MXFP4) return "MXFP4";
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
    ds_strtab by_name;
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
                       "BF16, U8, I8, I32, I64, F64, F8_E4M3)",
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
        int prev = ds_strtab_insert(&st->by_name, i, st->tensors[i].name, tensor_name_at, st, err);
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
    ds_strtab shard_tab = {0};
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
        int prev = ds_strtab_insert(&shard_tab, sl.n, fname, shard_name_at, &sl, err);
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
        int si = ds_strtab_find(&shard_tab, fname, shard_name_at, &sl);
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
    ds_strtab_free(&shard_tab);
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
    ds_strtab_free(&st->by_name);
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
    int i = ds_strtab_find(&st->by_name, name, tensor_name_at, st);
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
