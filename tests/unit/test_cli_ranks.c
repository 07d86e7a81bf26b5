/* `deltaserve logits -tp T -pp P` end to end, through $DS_BIN (which re-launches itself through
 * mpirun, or is started by it):
 *   invariant 3: PP 2 and PP 4 at T = 1 are bit-exact with one process, on tiny-k3 (AttnRes blocks
 *     that open on one stage and close on the next, a boundary on every bank) and tiny-linear;
 *   invariant 4: TP 2 and PP 2 x TP 2 logits within 1e-4 (relative) of one process, and the
 *     greedy token at every position the same, on two prompts; PP 2 x TP 4 (8 ranks) once;
 *   usage errors before any rank starts;
 *   `bench` over the same ranks decodes the same greedy tokens as one process. */
#include "kernels/cpu/kernels.h"
#include "devtools/init_model.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char *g_tmp;
static char g_k3[4096], g_lin[4096];
static const char *IDS_A = "1,5,9,200,17,33,600,2,2,8,41,77,300,12,5,5,690,3,44,101";
static const char *IDS_B = "700,3,3,3,19,250,511,64,9,1,0,23";

/* Runs `[prefix] $DS_BIN args 2>&1`; returns the exit status, output in out[cap]. */
static int run(const char *prefix, const char *args, char *out, size_t cap) {
    const char *bin = getenv("DS_BIN");
    if (!bin || access(bin, X_OK) != 0)
        fail_msg("DS_BIN (%s) is not an executable deltaserve", bin ? bin : "unset");
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "env OMP_NUM_THREADS=1 timeout -s KILL 120 %s '%s' %s 2>&1", prefix,
             bin, args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Reads a float32 .npy written by `logits`: data into *v, element count returned. */
static size_t read_npy(const char *path, float **v) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("%s: missing", path);
    unsigned char head[10];
    assert_int_equal(fread(head, 1, 10, f), 10);
    size_t hlen = head[8] | (size_t)head[9] << 8;
    fseek(f, 0, SEEK_END);
    size_t bytes = (size_t)ftell(f) - 10 - hlen;
    fseek(f, (long)(10 + hlen), SEEK_SET);
    *v = malloc(bytes);
    assert_int_equal(fread(*v, 1, bytes, f), bytes);
    fclose(f);
    return bytes / sizeof(float);
}

/* logits of `ids` on `model` with extra flags; returns the values and their count. */
static size_t logits(const char *model, const char *ids, const char *flags, float **v) {
    static int k;
    char path[4096], args[12288], out[16384];
    snprintf(path, sizeof path, "%s/l%d.npy", g_tmp, k++);
    snprintf(args, sizeof args, "logits -m '%s' --token-ids %s -o '%s' %s", model, ids, path,
             flags);
    int rc = run("", args, out, sizeof out);
    if (rc) fail_msg("logits %s: exit %d\n%s", flags, rc, out);
    return read_npy(path, v);
}

static void expect_bitexact(const char *model, const char *flags) {
    float *ref, *got;
    size_t n = logits(model, IDS_A, "", &ref);
    assert_int_equal(logits(model, IDS_A, flags, &got), n);
    if (memcmp(ref, got, n * sizeof(float))) fail_msg("%s %s: not bit-exact", model, flags);
    free(ref);
    free(got);
}

/* Within 1e-4 of one process, and the same argmax at every position (rows of V = 1024). */
static void expect_close(const char *model, const char *ids, const char *flags) {
    float *ref, *got;
    size_t n = logits(model, ids, "", &ref);
    assert_int_equal(logits(model, ids, flags, &got), n);
    double rel = ds_test_rel_err_f(got, ref, n);
    if (rel > 1e-4) fail_msg("%s %s: relative error %.3g", model, flags, rel);
    enum { V = 1024 };
    for (size_t t = 0; t < n / V; t++)
        if (ds_argmax(got + t * V, V) != ds_argmax(ref + t * V, V))
            fail_msg("%s %s: greedy token differs at position %zu", model, flags, t);
    free(ref);
    free(got);
}

static int setup(void **state) {
    (void)state;
    g_tmp = ds_test_tmpdir();
    snprintf(g_k3, sizeof g_k3, "%s/k3", g_tmp);
    snprintf(g_lin, sizeof g_lin, "%s/lin", g_tmp);
    ds_err err = {{0}};
    if (ds_init_model("tiny-k3", g_k3, 0, &err) || ds_init_model("tiny-linear", g_lin, 0, &err))
        fail_msg("%s", err.msg);
    /* ranks under ASan: Open MPI's allocations outlive MPI_Finalize (see test_transport_comm.c) */
    const char *asan = getenv("ASAN_OPTIONS");
    char buf[1024];
    snprintf(buf, sizeof buf, "%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", buf, 1);
    return 0;
}

static void test_pp_bitexact(void **state) {
    (void)state;
    /* tiny-k3: 10 layers, AttnRes banks at 0, 3, 6, 9. PP 2 = 5,5 (the block opened at 3 closes
     * at 6 on stage 1); PP 4 = 2,3,3,2; 3,3,3,1 puts every boundary on a bank. */
    expect_bitexact(g_k3, "-pp 2");
    expect_bitexact(g_k3, "-pp 4");
    expect_bitexact(g_k3, "-pp 4 --pp-layer-partition 3,3,3,1");
    expect_bitexact(g_lin, "-pp 2");
    expect_bitexact(g_lin, "-pp 4");
}

static void test_tp_close(void **state) {
    (void)state;
    expect_close(g_k3, IDS_A, "-tp 2");
    expect_close(g_k3, IDS_B, "-tp 2");
    expect_close(g_k3, IDS_A, "-tp 4");
    expect_close(g_k3, IDS_A, "-tp 2 -pp 2");
    expect_close(g_lin, IDS_B, "-tp 2 -pp 2");
    expect_close(g_k3, IDS_B, "-tp 4 -pp 2"); /* 8 ranks */
}

/* Started by mpirun (as across hosts with a hostfile) instead of launching itself. */
static void test_under_mpirun(void **state) {
    (void)state;
    float *ref, *got;
    size_t n = logits(g_lin, IDS_A, "", &ref);
    char path[4096], args[12288], out[16384];
    snprintf(path, sizeof path, "%s/direct.npy", g_tmp);
    snprintf(args, sizeof args, "logits -m '%s' --token-ids %s -o '%s' -pp 2", g_lin, IDS_A, path);
    int rc = run("mpirun --oversubscribe --allow-run-as-root -np 2", args, out, sizeof out);
    if (rc) fail_msg("exit %d\n%s", rc, out);
    assert_int_equal(read_npy(path, &got), n);
    assert_memory_equal(got, ref, n * sizeof(float));
    free(ref);
    free(got);
    /* the wrong number of ranks: every rank refuses, the job fails */
    rc = run("mpirun --oversubscribe --allow-run-as-root -np 3", args, out, sizeof out);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "-tp 1 x -pp 2 needs 2 ranks, but mpirun started 3"));
}

/* `bench -tp/-pp`: the decode steps' greedy tokens (the JSON's ids_hash per batch size) are
 * those of one process, and one line of results comes from the reporting rank only. */
static void bench_hashes(const char *model, const char *flags, char hashes[2][17]) {
    static int k;
    char path[4096], args[12288], out[16384];
    snprintf(path, sizeof path, "%s/b%d.json", g_tmp, k++);
    snprintf(args, sizeof args,
             "bench -m '%s' --prompt-tokens 24 --decode-context 12 --decode-steps 4 "
             "--batch-sizes 1,3 --json '%s' %s",
             model, path, flags);
    int rc = run("", args, out, sizeof out);
    if (rc) fail_msg("bench %s: exit %d\n%s", flags, rc, out);
    const char *row = strstr(out, "decode batch 3");
    assert_non_null(row);
    assert_null(strstr(row + 1, "decode batch 3")); /* one reporting rank */
    size_t len;
    ds_err err = {{0}};
    char *js = ds_read_file(path, &len, &err);
    assert_non_null(js);
    const char *at = js;
    for (int i = 0; i < 2; i++) {
        at = strstr(at, "\"ids_hash\": \"");
        assert_non_null(at);
        at += strlen("\"ids_hash\": \"");
        memcpy(hashes[i], at, 16);
        hashes[i][16] = 0;
    }
    free(js);
}

static void test_bench_ranks(void **state) {
    (void)state;
    /* random weights too (config.json only): every rank draws its slice of the one-process
     * model, whatever slice it holds */
    char rnd[4200];
    snprintf(rnd, sizeof rnd, "%s/rk3", g_tmp);
    assert_int_equal(mkdir(rnd, 0755), 0);
    assert_int_equal(ds_test_copy_config(g_k3, rnd), 0);
    const char *models[] = {g_k3, rnd}, *extra[] = {"", "--load-format random"};
    char ref[2][17], got[2][17], real[2][17] = {{0}}, fl[256];
    for (int k = 0; k < 2; k++) {
        bench_hashes(models[k], extra[k], ref);
        assert_string_not_equal(ref[0], ref[1]); /* batch 1 and 3 decode different tokens */
        if (k == 1) assert_string_not_equal(ref[0], real[0]); /* a model of its own */
        memcpy(real, ref, sizeof real);
        const char *flags[] = {"-pp 2", "-tp 2", "-pp 2 -tp 2"};
        for (size_t i = 0; i < sizeof flags / sizeof *flags; i++) {
            snprintf(fl, sizeof fl, "%s %s", extra[k], flags[i]);
            bench_hashes(models[k], fl, got);
            if (strcmp(got[0], ref[0]) || strcmp(got[1], ref[1]))
                fail_msg("bench %s: greedy tokens %s %s, one process %s %s", fl, got[0], got[1],
                         ref[0], ref[1]);
        }
    }
    /* --decode-fill zeros: no prefill of the context, so its steps decode other tokens than
     * after the prompt's (the same, were the flag ignored) */
    char zero[2][17];
    bench_hashes(rnd, "--load-format random --decode-fill zeros", zero);
    assert_string_not_equal(zero[0], ref[0]);
    assert_string_not_equal(zero[1], ref[1]);
    char args[8192], out[16384];
    snprintf(args, sizeof args, "bench -m '%s' --decode-fill some", g_k3);
    assert_int_equal(run("", args, out, sizeof out), 2);
    assert_non_null(strstr(out, "decode-fill"));
    snprintf(args, sizeof args, "bench -m '%s' -pp 11", g_k3);
    assert_int_equal(run("", args, out, sizeof out), 2);
    assert_non_null(strstr(out, "11 stages for 10 layers"));
}

static void test_usage_errors(void **state) {
    (void)state;
    char args[8192], out[16384];
    snprintf(args, sizeof args, "logits -m '%s' --token-ids 1,2 -o /dev/null -tp 3", g_k3);
    assert_int_equal(run("", args, out, sizeof out), 2);
    assert_non_null(strstr(out, "tensor parallel size 3 does not divide the model's 4 KDA heads"));
    snprintf(args, sizeof args,
             "logits -m '%s' --token-ids 1,2 -o /dev/null -pp 2 --pp-layer-partition 4,4", g_k3);
    assert_int_equal(run("", args, out, sizeof out), 2);
    assert_non_null(strstr(out, "sums to 8 layers, the model has 10"));
    snprintf(args, sizeof args, "logits -m '%s' --token-ids 1,2 -o /dev/null -pp 11", g_k3);
    assert_int_equal(run("", args, out, sizeof out), 2);
    assert_non_null(strstr(out, "11 stages for 10 layers"));
    assert_null(strstr(out, "mpirun")); /* refused before any rank was started */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pp_bitexact),  cmocka_unit_test(test_tp_close),
        cmocka_unit_test(test_under_mpirun), cmocka_unit_test(test_bench_ranks),
        cmocka_unit_test(test_usage_errors),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
