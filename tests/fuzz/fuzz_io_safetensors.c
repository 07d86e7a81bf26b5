/* fuzz_io_safetensors.c — libFuzzer target for the safetensors reader (src/io/safetensors.c).
 *
 * Input, by its first byte:
 *   even: the rest is one .safetensors file, opened from a memfd through /proc/self/fd (the real
 *         open + fstat + mmap path, no disk);
 *   odd:  the rest is "<index.json>\n--8<-- a\n<a.safetensors>\n--8<-- b\n<b.safetensors>",
 *         written to a folder and opened with ds_st_open_dir (the sharded path).
 * On success every tensor is checked against what the reader promises (size = dtype x shape,
 * found by name, bytes readable and convertible), and a single file is written back with the
 * writer and re-read: the same tensors, shapes and bytes must come out. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzzutil.h"
#include "io/safetensors.h"

static volatile uint8_t g_sink;

/* Checks the reader's promises about every tensor of st. */
static void check_tensors(const ds_st *st) {
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *t = ds_st_at(st, i);
        if (!t || !t->name) fz_fail("tensor %d missing", i);
        if (ds_st_find(st, t->name) != t) fz_fail("'%s' not found by name", t->name);
        if (t->ndim < 0 || t->ndim > DS_MAX_DIMS) fz_fail("'%s': ndim %d", t->name, t->ndim);
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0) fz_fail("'%s': negative dim", t->name);
            numel *= (uint64_t)t->shape[d];
        }
        if ((uint64_t)t->numel != numel || t->nbytes != numel * ds_dtype_size(t->dtype))
            fz_fail("'%s': numel/nbytes disagree with the shape", t->name);
        int64_t neg[DS_MAX_DIMS];
        for (int d = 0; d < DS_MAX_DIMS; d++) neg[d] = -1;
        const ds_tensor *g = NULL;
        ds_err err;
        if (ds_st_get(st, t->name, 1u << t->dtype, t->ndim, neg, &g, &err) != DS_OK || g != t)
            fz_fail("ds_st_get('%s') failed: %s", t->name, err.msg);
        /* Touch every byte: an offset outside the mapping faults here. */
        const uint8_t *p = t->data;
        uint8_t x = 0;
        for (size_t k = 0; k < t->nbytes; k++) x ^= p[k];
        g_sink = x;
        if (t->numel <= (1 << 16)) {
            float *f = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *f);
            if (!f) fz_fail("out of memory");
            int rc = ds_tensor_to_f32(t, f, &err);
            int is_float = t->dtype == DS_DT_F32 || t->dtype == DS_DT_F16 ||
                           t->dtype == DS_DT_BF16 || t->dtype == DS_DT_F64;
            if ((rc == DS_OK) != is_float) fz_fail("'%s': to_f32 rc %d for dtype", t->name, rc);
            free(f);
        }
    }
    (void)ds_st_metadata(st, "format");
}

/* Writes st back as one file and re-reads it: same names, dtypes, shapes, bytes, metadata. */
static void check_roundtrip(const ds_st *st) {
    ds_err err;
    size_t total = 0;
    for (int i = 0; i < ds_st_count(st); i++) total += ds_st_at(st, i)->nbytes;
    if (total > (1u << 20)) return;
    ds_st_writer *w = ds_st_writer_new(&err);
    if (!w) fz_fail("writer: %s", err.msg);
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *t = ds_st_at(st, i);
        if (ds_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, &err) != DS_OK)
            fz_fail("writer_add('%s'): %s", t->name, err.msg);
    }
    const char *mv = ds_st_metadata(st, "format");
    if (mv && ds_st_writer_set_metadata(w, "format", mv, &err) != DS_OK)
        fz_fail("writer metadata: %s", err.msg);
    char path[1024];
    snprintf(path, sizeof path, "%s", fz_write("rt.safetensors", "", 0));
    if (ds_st_writer_write(w, path, &err) != DS_OK) fz_fail("writer_write: %s", err.msg);
    ds_st_writer_free(w);
    ds_st *r = NULL;
    if (ds_st_open_file(path, &r, &err) != DS_OK) fz_fail("re-reading what we wrote: %s", err.msg);
    if (ds_st_count(r) != ds_st_count(st)) fz_fail("round trip changed the tensor count");
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *a = ds_st_at(st, i), *b = ds_st_find(r, a->name);
        if (!b || b->dtype != a->dtype || b->ndim != a->ndim || b->nbytes != a->nbytes ||
            memcmp(b->shape, a->shape, (size_t)a->ndim * sizeof a->shape[0]) != 0 ||
            (a->nbytes && memcmp(a->data, b->data, a->nbytes) != 0))
            fz_fail("round trip changed tensor '%s'", a->name);
    }
    const char *mr = ds_st_metadata(r, "format");
    if ((mv == NULL) != (mr == NULL) || (mv && strcmp(mv, mr) != 0))
        fz_fail("round trip changed the metadata");
    ds_st_close(r);
}

static void one_file(const uint8_t *data, size_t size) {
    int fd = memfd_create("ds-fuzz-st", MFD_CLOEXEC);
    if (fd < 0) fz_fail("memfd_create failed");
    for (size_t o = 0; o < size;) {
        ssize_t k = write(fd, data + o, size - o);
        if (k <= 0) fz_fail("write to memfd failed");
        o += (size_t)k;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ds_st *st = NULL;
    ds_err err;
    int rc = ds_st_open_file(path, &st, &err);
    fz_note("open_file", rc, err.msg);
    if (rc == DS_OK) {
        check_tensors(st);
        check_roundtrip(st);
        ds_st_close(st);
    } else if (!err.msg[0]) {
        fz_fail("error without a message");
    }
    close(fd);
}

static void sharded(const uint8_t *data, size_t size) {
    const uint8_t *part[3];
    size_t len[3];
    int n = fz_split(data, size, "\n--8<-- ", part, len, 3);
    /* part 1 and 2 start with "a\n" / "b\n": the name of the shard that follows */
    fz_remove("a.safetensors");
    fz_remove("b.safetensors");
    fz_write("model.safetensors.index.json", part[0], len[0]);
    for (int i = 1; i < n; i++) {
        if (len[i] < 2 || part[i][1] != '\n') continue;
        char name[32];
        snprintf(name, sizeof name, "%c.safetensors", part[i][0] == 'a' ? 'a' : 'b');
        fz_write(name, part[i] + 2, len[i] - 2);
    }
    ds_st *st = NULL;
    ds_err err;
    int rc = ds_st_open_dir(fz_dir(), &st, &err);
    fz_note("open_dir", rc, err.msg);
    if (rc == DS_OK) {
        check_tensors(st);
        ds_st_close(st);
    } else if (!err.msg[0]) {
        fz_fail("error without a message");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] & 1)
        sharded(data + 1, size - 1);
    else
        one_file(data + 1, size - 1);
    return 0;
}
