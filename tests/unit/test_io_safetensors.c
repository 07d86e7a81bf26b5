/* test_io_safetensors.c — writer round trip, sharded sets, and every malformed-file rule of the
 * reader, each built by hand as bytes so the test does not depend on the writer being right. */
#include "testutil.h"

#include "io/safetensors.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void assert_contains(const char *msg, const char *needle) {
    if (!strstr(msg, needle)) fail_msg("message \"%s\" does not contain \"%s\"", msg, needle);
}

/* Removes every file in dir, then dir. */
static void rm_tree(char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        char p[1024];
        while ((de = readdir(d)) != NULL) {
            if (de->d_name[0] == '.') continue;
            snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(dir);
    free(dir);
}

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) n += de->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Writes [u64 N][header padded with spaces to pad][data] to dir/name; returns the path. */
static char *write_raw(const char *dir, const char *name, const char *header, size_t pad,
                       const void *data, size_t dlen) {
    size_t hl = strlen(header), n = hl > pad ? hl : pad;
    size_t total = 8 + n + dlen;
    uint8_t *buf = calloc(1, total);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memset(buf + 8, ' ', n);
    memcpy(buf + 8, header, hl);
    if (dlen) memcpy(buf + 8 + n, data, dlen);
    char *path = malloc(strlen(dir) + strlen(name) + 2);
    sprintf(path, "%s/%s", dir, name);
    assert_int_equal(ds_test_write_file(path, buf, total), 0);
    free(buf);
    return path;
}

/* Opens a hand-made file that must fail; the message must name the file and n1 (and n2). */
static void expect_bad(const char *header, const void *data, size_t dlen, const char *n1,
                       const char *n2) {
    char *dir = ds_test_tmpdir();
    char *path = write_raw(dir, "bad.safetensors", header, 0, data, dlen);
    ds_st *st = (ds_st *)1;
    ds_err e = {{0}};
    if (ds_st_open_file(path, &st, &e) != DS_ERR)
        fail_msg("header %s opened but should fail with '%s'", header, n1);
    assert_null(st);
    if (getenv("DS_TEST_VERBOSE")) fprintf(stderr, "%s\n", e.msg);
    assert_contains(e.msg, path);
    assert_contains(e.msg, n1);
    if (n2) assert_contains(e.msg, n2);
    free(path);
    rm_tree(dir);
}

/* ---- writer round trip ------------------------------------------------------------------- */

static void test_roundtrip(void **state) {
    (void)state;
    char *dir = ds_test_tmpdir();
    ds_err e;
    ds_st_writer *w = ds_st_writer_new(&e);
    assert_non_null(w);

    uint16_t bf[6]; /* [2, 3] */
    float bf_ref[6] = {1.0f, -2.5f, 3.140625f, 0.0f, -0.0078125f, 65280.0f};
    for (int i = 0; i < 6; i++) bf[i] = ds_f32_to_bf16(bf_ref[i]);
    uint16_t hf[4]; /* [4] */
    float hf_ref[4] = {0.5f, -1.75f, 1024.0f, 5.9604645e-08f /* smallest f16 subnormal */};
    for (int i = 0; i < 4; i++) hf[i] = ds_f32_to_f16(hf_ref[i]);
    float f32[6] = {1e-3f, 2, 3, 4, 5, -6}; /* [3, 2] */
    double f64[2] = {0.25, -1e10};          /* [2] */
    int64_t i64[3] = {1, -2, 1LL << 40};    /* [3] */
    float scalar = 42.0f;                   /* [] */
    int64_t s_bf[2] = {2, 3}, s_hf[1] = {4}, s_f32[2] = {3, 2}, s_f64[1] = {2}, s_i64[1] = {3},
            s_empty[2] = {0, 5};
    /* insertion order mixes sizes so the writer's size-sorted layout is exercised */
    assert_int_equal(ds_st_writer_add(w, "a.bf16", DS_DT_BF16, 2, s_bf, bf, &e), DS_OK);
    assert_int_equal(ds_st_writer_add(w, "b.f32", DS_DT_F32, 2, s_f32, f32, &e), DS_OK);
    assert_int_equal(ds_st_writer_add(w, "c.f16", DS_DT_F16, 1, s_hf, hf, &e), DS_OK);
    assert_int_equal(ds_st_writer_add(w, "d.f64", DS_DT_F64, 1, s_f64, f64, &e), DS_OK);
    assert_int_equal(ds_st_writer_add(w, "e.i64", DS_DT_I64, 1, s_i64, i64, &e), DS_OK);
    assert_int_equal(ds_st_writer_add(w, "f.scalar", DS_DT_F32, 0, NULL, &scalar, &e), DS_OK);
    assert_int_equal(ds_st_writer_add(w, "g.empty", DS_DT_BF16, 2, s_empty, NULL, &e), DS_OK);
    assert_int_equal(ds_st_writer_add(w, "a.bf16", DS_DT_F32, 1, s_hf, f32, &e), DS_ERR);
    assert_contains(e.msg, "a.bf16");
    assert_int_equal(ds_st_writer_set_metadata(w, "format", "pt", &e), DS_OK);
    assert_int_equal(ds_st_writer_set_metadata(w, "note", "quote \" and \\ ok", &e), DS_OK);
    assert_int_equal(ds_st_writer_bytes(w), 12 + 24 + 8 + 16 + 24 + 4);
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(ds_st_writer_write(w, path, &e), DS_OK);
    ds_st_writer_free(w);
    assert_int_equal(count_files(dir), 1); /* no temporary left behind */

    /* header length is a multiple of 8 and keys keep insertion order */
    size_t len;
    char *raw = ds_read_file(path, &len, &e);
    assert_non_null(raw);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | (uint8_t)raw[i];
    assert_int_equal(n % 8, 0);
    assert_int_equal(len, 8 + n + 12 + 24 + 8 + 16 + 24 + 4);
    const char *hdr = raw + 8;
    const char *pa = strstr(hdr, "\"a.bf16\""), *pb = strstr(hdr, "\"b.f32\""),
               *pg = strstr(hdr, "\"g.empty\""), *pm = strstr(hdr, "__metadata__");
    assert_true(pm && pa && pb && pg && pm < pa && pa < pb && pb < pg);
    free(raw);

    ds_st *st;
    assert_int_equal(ds_st_open_dir(dir, &st, &e), DS_OK);
    assert_int_equal(ds_st_count(st), 7);
    assert_string_equal(ds_st_at(st, 0)->name, "a.bf16");
    assert_string_equal(ds_st_at(st, 6)->name, "g.empty");
    assert_null(ds_st_at(st, 7));
    assert_string_equal(ds_st_metadata(st, "format"), "pt");
    assert_string_equal(ds_st_metadata(st, "note"), "quote \" and \\ ok");
    assert_null(ds_st_metadata(st, "absent"));
    assert_null(ds_st_find(st, "nope"));

    const ds_tensor *t = ds_st_find(st, "a.bf16");
    assert_non_null(t);
    assert_int_equal(t->dtype, DS_DT_BF16);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->numel, 6);
    assert_int_equal(t->nbytes, 12);
    assert_string_equal(t->file, path);
    float out[6];
    assert_int_equal(ds_tensor_to_f32(t, out, &e), DS_OK);
    for (int i = 0; i < 6; i++) assert_float_equal(out[i], bf_ref[i], 0);
    assert_memory_equal(t->data, bf, sizeof bf);

    t = ds_st_find(st, "c.f16");
    assert_int_equal(t->dtype, DS_DT_F16);
    assert_int_equal(ds_tensor_to_f32(t, out, &e), DS_OK);
    for (int i = 0; i < 4; i++) assert_float_equal(out[i], hf_ref[i], 0);

    t = ds_st_find(st, "b.f32");
    assert_int_equal(t->dtype, DS_DT_F32);
    assert_int_equal(t->shape[0], 3);
    assert_int_equal(ds_tensor_to_f32(t, out, &e), DS_OK);
    for (int i = 0; i < 6; i++) assert_float_equal(out[i], f32[i], 0);

    t = ds_st_find(st, "d.f64");
    assert_int_equal(ds_tensor_to_f32(t, out, &e), DS_OK);
    assert_float_equal(out[0], 0.25f, 0);
    assert_float_equal(out[1], -1e10f, 0);

    t = ds_st_find(st, "e.i64");
    assert_int_equal(t->dtype, DS_DT_I64);
    assert_memory_equal(t->data, i64, sizeof i64);
    assert_int_equal(ds_tensor_to_f32(t, out, &e), DS_ERR); /* not a float type */
    assert_contains(e.msg, "e.i64");

    t = ds_st_find(st, "f.scalar");
    assert_int_equal(t->ndim, 0);
    assert_int_equal(t->numel, 1);
    assert_int_equal(ds_tensor_to_f32(t, out, &e), DS_OK);
    assert_float_equal(out[0], 42.0f, 0);

    t = ds_st_find(st, "g.empty");
    assert_int_equal(t->numel, 0);
    assert_int_equal(t->nbytes, 0);

    /* every tensor is aligned to its element size inside the 8-aligned data section */
    const uint8_t *data0 = (const uint8_t *)ds_st_find(st, "d.f64")->data; /* 8-byte dtypes first */
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *x = ds_st_at(st, i);
        size_t off = (size_t)((const uint8_t *)x->data - data0);
        assert_int_equal(off % ds_dtype_size(x->dtype), 0);
    }
    assert_int_equal(((size_t)data0 - 8 - n) % 4096, 0); /* mmap base is page aligned */
    ds_st_close(st);
    ds_st_close(NULL);
    rm_tree(strdup(dir));
    free(dir);
}

static void test_get_checks(void **state) {
    (void)state;
    char *dir = ds_test_tmpdir();
    ds_err e;
    ds_st_writer *w = ds_st_writer_new(&e);
    uint16_t q[4 * 7] = {0}; /* [4, 7] */
    int64_t sq[2] = {4, 7};
    const char *name = "model.layers.0.self_attn.q_proj.weight";
    assert_int_equal(ds_st_writer_add(w, name, DS_DT_BF16, 2, sq, q, &e), DS_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/one.safetensors", dir);
    assert_int_equal(ds_st_writer_write(w, path, &e), DS_OK);
    ds_st_writer_free(w);
    ds_st *st;
    assert_int_equal(ds_st_open_dir(dir, &st, &e), DS_OK); /* the single *.safetensors file */

    const ds_tensor *t = NULL;
    int64_t want[2] = {4, 7}, wild[2] = {-1, 7}, wrong[2] = {4, 6};
    assert_int_equal(ds_st_get(st, name, 1u << DS_DT_BF16, 2, want, &t, &e), DS_OK);
    assert_non_null(t);
    assert_int_equal(ds_st_get(st, name, (1u << DS_DT_BF16) | (1u << DS_DT_F32), 2, wild, &t, &e),
                     DS_OK);

    char expect[1024];
    assert_int_equal(ds_st_get(st, name, 1u << DS_DT_BF16, 2, wrong, &t, &e), DS_ERR);
    assert_null(t);
    snprintf(expect, sizeof expect,
             "%s: tensor '%s': expected shape [4, 6] dtype BF16, found shape [4, 7] dtype BF16",
             path, name);
    assert_string_equal(e.msg, expect);

    assert_int_equal(ds_st_get(st, name, (1u << DS_DT_F32) | (1u << DS_DT_F16), 2, wild, &t, &e),
                     DS_ERR);
    snprintf(expect, sizeof expect,
             "%s: tensor '%s': expected shape [?, 7] dtype F32|F16, found shape [4, 7] dtype BF16",
             path, name);
    assert_string_equal(e.msg, expect);

    int64_t three[3] = {4, 7, 1};
    assert_int_equal(ds_st_get(st, name, 1u << DS_DT_BF16, 3, three, &t, &e), DS_ERR);
    assert_contains(e.msg, "expected shape [4, 7, 1]");

    assert_int_equal(ds_st_get(st, "model.norm.weight", 1u << DS_DT_BF16, 2, want, &t, &e), DS_ERR);
    assert_contains(e.msg, "model.norm.weight");
    assert_contains(e.msg, path);
    assert_contains(e.msg, "not found");
    ds_st_close(st);
    rm_tree(dir);
}

/* Many names: exercises hash-table growth and probing. */
static void test_many_tensors(void **state) {
    (void)state;
    char *dir = ds_test_tmpdir();
    ds_err e;
    ds_st_writer *w = ds_st_writer_new(&e);
    enum { N = 5000 };
    int64_t one[1] = {1};
    char name[64];
    for (int i = 0; i < N; i++) {
        float v = (float)i;
        snprintf(name, sizeof name, "model.layers.%d.w", i);
        assert_int_equal(ds_st_writer_add(w, name, DS_DT_F32, 1, one, &v, &e), DS_OK);
    }
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(ds_st_writer_write(w, path, &e), DS_OK);
    ds_st_writer_free(w);
    ds_st *st;
    assert_int_equal(ds_st_open_file(path, &st, &e), DS_OK);
    assert_int_equal(ds_st_count(st), N);
    for (int i = N - 1; i >= 0; i--) {
        snprintf(name, sizeof name, "model.layers.%d.w", i);
        const ds_tensor *t = ds_st_find(st, name);
        assert_non_null(t);
        float v;
        memcpy(&v, t->data, 4);
        assert_float_equal(v, (float)i, 0);
    }
    assert_null(ds_st_find(st, "model.layers.5000.w"));
    ds_st_close(st);
    rm_tree(dir);
}

/* ---- sharded sets ------------------------------------------------------------------------ */

static void write_shard(const char *dir, const char *file, const char *const *names, int n,
                        float base) {
    ds_err e;
    ds_st_writer *w = ds_st_writer_new(&e);
    int64_t sh[1] = {2};
    for (int i = 0; i < n; i++) {
        float v[2] = {base + (float)i, -(base + (float)i)};
        assert_int_equal(ds_st_writer_add(w, names[i], DS_DT_F32, 1, sh, v, &e), DS_OK);
    }
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    assert_int_equal(ds_st_writer_write(w, path, &e), DS_OK);
    ds_st_writer_free(w);
}

static void write_index(const char *dir, const char *json) {
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    assert_int_equal(ds_test_write_file(path, json, strlen(json)), 0);
}

static const char *const S1[] = {"embed.weight", "layers.0.w"};
static const char *const S2[] = {"layers.1.w", "norm.weight", "lm_head.weight"};
#define GOOD_INDEX                                                                                 \
    "{\"metadata\": {\"total_size\": 40}, \"weight_map\": {"                                       \
    "\"embed.weight\": \"model-00001-of-00002.safetensors\","                                      \
    "\"layers.0.w\": \"model-00001-of-00002.safetensors\","                                        \
    "\"layers.1.w\": \"model-00002-of-00002.safetensors\","                                        \
    "\"norm.weight\": \"model-00002-of-00002.safetensors\","                                       \
    "\"lm_head.weight\": \"model-00002-of-00002.safetensors\"}}"

static char *sharded_dir(void) {
    char *dir = ds_test_tmpdir();
    write_shard(dir, "model-00001-of-00002.safetensors", S1, 2, 10);
    write_shard(dir, "model-00002-of-00002.safetensors", S2, 3, 20);
    write_index(dir, GOOD_INDEX);
    return dir;
}

static void expect_dir_err(const char *dir, const char *n1, const char *n2, const char *n3) {
    ds_st *st = (ds_st *)1;
    ds_err e = {{0}};
    if (ds_st_open_dir(dir, &st, &e) != DS_ERR) fail_msg("expected error containing '%s'", n1);
    assert_null(st);
    if (getenv("DS_TEST_VERBOSE")) fprintf(stderr, "%s\n", e.msg);
    assert_contains(e.msg, n1);
    if (n2) assert_contains(e.msg, n2);
    if (n3) assert_contains(e.msg, n3);
}

static void test_sharded(void **state) {
    (void)state;
    char *dir = sharded_dir();
    ds_st *st;
    ds_err e;
    assert_int_equal(ds_st_open_dir(dir, &st, &e), DS_OK);
    assert_int_equal(ds_st_count(st), 5);
    const ds_tensor *a = ds_st_find(st, "layers.0.w"), *b = ds_st_find(st, "lm_head.weight");
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(strstr(a->file, "model-00001-of-00002.safetensors"));
    assert_non_null(strstr(b->file, "model-00002-of-00002.safetensors"));
    float v[2];
    assert_int_equal(ds_tensor_to_f32(a, v, &e), DS_OK);
    assert_float_equal(v[0], 11.0f, 0);
    assert_int_equal(ds_tensor_to_f32(b, v, &e), DS_OK);
    assert_float_equal(v[1], -22.0f, 0);
    ds_st_close(st);
    rm_tree(dir);
}

static void test_sharded_bad(void **state) {
    (void)state;
    /* a shard file is missing */
    char *dir = sharded_dir();
    char p[512];
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    unlink(p);
    expect_dir_err(dir, "model.safetensors.index.json", "model-00002-of-00002.safetensors",
                   "cannot open");
    rm_tree(dir);

    /* the index maps a tensor its shard does not hold */
    dir = sharded_dir();
    write_index(dir, "{\"weight_map\": {\"embed.weight\": \"model-00001-of-00002.safetensors\","
                     "\"ghost.weight\": \"model-00002-of-00002.safetensors\"}}");
    expect_dir_err(dir, "ghost.weight", "model-00002-of-00002.safetensors", "does not hold");
    rm_tree(dir);

    /* the index names the wrong shard */
    dir = sharded_dir();
    write_index(dir, "{\"weight_map\": {\"embed.weight\": \"model-00001-of-00002.safetensors\","
                     "\"norm.weight\": \"model-00001-of-00002.safetensors\","
                     "\"layers.1.w\": \"model-00002-of-00002.safetensors\"}}");
    expect_dir_err(dir, "norm.weight", "lives in", NULL);
    rm_tree(dir);

    /* the same tensor in two shards */
    dir = sharded_dir();
    static const char *const dup[] = {"norm.weight"};
    write_shard(dir, "model-00001-of-00002.safetensors", dup, 1, 0);
    write_index(dir, "{\"weight_map\": {\"norm.weight\": \"model-00001-of-00002.safetensors\","
                     "\"layers.1.w\": \"model-00002-of-00002.safetensors\"}}");
    expect_dir_err(dir, "norm.weight", "appears twice", "model-00002-of-00002.safetensors");
    rm_tree(dir);

    /* index problems */
    dir = sharded_dir();
    write_index(dir, "{\"weight_map\": {\"a\": }");
    expect_dir_err(dir, "model.safetensors.index.json", "not valid JSON", NULL);
    write_index(dir, "{\"metadata\": {}}");
    expect_dir_err(dir, "model.safetensors.index.json", "weight_map", NULL);
    write_index(dir, "{\"weight_map\": {\"a\": 3}}");
    expect_dir_err(dir, "weight_map['a']", "string", NULL);
    write_index(dir, "{\"weight_map\": {\"a\": \"../x.safetensors\"}}");
    expect_dir_err(dir, "../x.safetensors", NULL, NULL);
    /* a broken shard is reported under the index with the shard's own message */
    write_index(dir, GOOD_INDEX);
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    assert_int_equal(ds_test_write_file(p, "\x04\0\0\0", 4), 0);
    expect_dir_err(dir, "model-00001-of-00002.safetensors", "shorter than", NULL);
    rm_tree(dir);
}

static void test_dir_fallbacks(void **state) {
    (void)state;
    char *dir = ds_test_tmpdir();
    expect_dir_err(dir, dir, "no model.safetensors", NULL);
    static const char *const one[] = {"x"};
    write_shard(dir, "a.safetensors", one, 1, 0);
    ds_st *st;
    ds_err e;
    assert_int_equal(ds_st_open_dir(dir, &st, &e), DS_OK);
    assert_non_null(ds_st_find(st, "x"));
    ds_st_close(st);
    write_shard(dir, "b.safetensors", one, 1, 0);
    expect_dir_err(dir, "2 *.safetensors files", NULL, NULL);
    rm_tree(dir);
}

/* ---- malformed files --------------------------------------------------------------------- */

static void test_bad_files(void **state) {
    (void)state;
    uint8_t data[64] = {0};
    char *dir = ds_test_tmpdir();
    char p[512];
    ds_st *st;
    ds_err e;

    /* shorter than the 8-byte length */
    snprintf(p, sizeof p, "%s/short.safetensors", dir);
    assert_int_equal(ds_test_write_file(p, "\x02\0\0\0", 4), 0);
    assert_int_equal(ds_st_open_file(p, &st, &e), DS_ERR);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "shorter than the 8-byte");
    /* N larger than the file */
    snprintf(p, sizeof p, "%s/long.safetensors", dir);
    assert_int_equal(ds_test_write_file(p, "\xe8\x03\0\0\0\0\0\0{}", 10), 0);
    assert_int_equal(ds_st_open_file(p, &st, &e), DS_ERR);
    assert_contains(e.msg, p);
    assert_contains(e.msg, "header length 1000");
    /* N near 2^64 must not wrap */
    assert_int_equal(ds_test_write_file(p, "\xff\xff\xff\xff\xff\xff\xff\xff{}", 10), 0);
    assert_int_equal(ds_st_open_file(p, &st, &e), DS_ERR);
    assert_contains(e.msg, "header length");
    /* not there */
    snprintf(p, sizeof p, "%s/absent.safetensors", dir);
    assert_int_equal(ds_st_open_file(p, &st, &e), DS_ERR);
    assert_contains(e.msg, p);
    rm_tree(dir);

    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], ", data, 4, "not valid JSON", NULL);
    expect_bad("[1, 2, 3]", data, 0, "must be a JSON object", NULL);
    expect_bad("{\"w\": [1]}", data, 0, "'w'", "must be an object");
    expect_bad("{\"w\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", data, 4, "'w'", "dtype");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", data, 4, "'w'", "shape");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1]}}", data, 4, "'w'", "data_offsets");
    expect_bad("{\"w\": {\"dtype\": 5, \"shape\": [1], \"data_offsets\": [0, 4]}}", data, 4, "'w'",
               "'dtype' must be a string");
    expect_bad("{\"w\": {\"dtype\": \"F8_E5M2\", \"shape\": [1], \"data_offsets\": [0, 1]}}", data,
               1, "'w'", "F8_E5M2");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": \"1\", \"data_offsets\": [0, 4]}}", data, 4,
               "'w'", "'shape' must be an array");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", data, 4,
               "'w'", "shape[0]");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", data, 4,
               "'w'", "negative");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], "
               "\"data_offsets\": [0, 4]}}",
               data, 4, "'w'", "dimensions");
    expect_bad("{\"w\": {\"dtype\": \"BF16\", \"shape\": [4294967296, 4294967296], "
               "\"data_offsets\": [0, 4]}}",
               data, 4, "'w'", "overflow");
    expect_bad("{\"w\": {\"dtype\": \"F64\", \"shape\": [2305843009213693952], "
               "\"data_offsets\": [0, 4]}}",
               data, 4, "'w'", "overflow");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", data, 4,
               "'w'", "data_offsets");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}", data, 8,
               "'w'", "begin <= end");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", data, 8,
               "'w'", "begin <= end");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", data, 8,
               "'w'", "header lies about size");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", data, 8,
               "'w'", "truncated");
    expect_bad("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
               " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
               data, 12, "'a'", "'b' [4, 12) overlap");
    /* overlap detected even when the wide tensor comes first and swallows a later one */
    expect_bad("{\"c\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [24, 28]},"
               " \"a\": {\"dtype\": \"F32\", \"shape\": [8], \"data_offsets\": [0, 32]},"
               " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}",
               data, 32, "'a'", "'b'");
    expect_bad("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
               " \"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
               data, 8, "duplicate tensor name", "\"w\"");
    expect_bad("{\"__metadata__\": {\"format\": 1}}", data, 0, "__metadata__", "format");
    /* found by fuzz_io_safetensors: read, but the writer refused to write it back */
    expect_bad("{\"\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", data, 4,
               "a tensor with an empty name", NULL);
}

/* Empty tensors own no bytes, and holes between tensors are allowed. */
static void test_edge_layouts(void **state) {
    (void)state;
    char *dir = ds_test_tmpdir();
    float d[4] = {1, 2, 3, 4};
    char *path =
        write_raw(dir, "edge.safetensors",
                  "{\"z\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 4]},"
                  " \"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                  " \"y\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [12, 16]}}",
                  256, d, sizeof d);
    ds_st *st;
    ds_err e;
    assert_int_equal(ds_st_open_file(path, &st, &e), DS_OK);
    float v[2];
    assert_int_equal(ds_tensor_to_f32(ds_st_find(st, "y"), v, &e), DS_OK);
    assert_float_equal(v[0], 4.0f, 0);
    assert_int_equal(ds_tensor_to_f32(ds_st_find(st, "x"), v, &e), DS_OK);
    assert_float_equal(v[1], 2.0f, 0);
    ds_st_close(st);
    free(path);
    rm_tree(dir);
}

static void test_writer_errors(void **state) {
    (void)state;
    ds_err e;
    ds_st_writer *w = ds_st_writer_new(&e);
    float v[2] = {1, 2};
    int64_t neg[1] = {-2}, ok[1] = {2};
    assert_int_equal(ds_st_writer_add(w, "n", DS_DT_F32, 1, neg, v, &e), DS_ERR);
    assert_contains(e.msg, "'n'");
    assert_int_equal(ds_st_writer_add(w, "__metadata__", DS_DT_F32, 1, ok, v, &e), DS_ERR);
    assert_int_equal(ds_st_writer_add(w, "m", DS_DT_F32, 1, ok, NULL, &e), DS_ERR);
    assert_int_equal(ds_st_writer_add(w, "m", DS_DT_F32, 1, ok, v, &e), DS_OK);
    const char *bad = "/nonexistent-dir-ds/x.safetensors";
    assert_int_equal(ds_st_writer_write(w, bad, &e), DS_ERR);
    assert_contains(e.msg, bad);
    ds_st_writer_free(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),     cmocka_unit_test(test_get_checks),
        cmocka_unit_test(test_many_tensors),  cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_sharded_bad),   cmocka_unit_test(test_dir_fallbacks),
        cmocka_unit_test(test_bad_files),     cmocka_unit_test(test_edge_layouts),
        cmocka_unit_test(test_writer_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
