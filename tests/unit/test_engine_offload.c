/* test_engine_offload.c — the RAM / disk / Redis offload tier (invariant 5): pages and KDA
 * checkpoints stored when they leave the device pools or their request finishes, and loaded on a
 * later hit, give exactly the cold greedy tokens; a damaged disk entry is a counted miss; a Redis
 * server killed mid-run costs only misses. redis-server must be installed (`make` installs it):
 * without it the Redis tests fail, they are not skipped. */
#include "engine_harness.h"

#include "devtools/init_model.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NA = 100, GEN = 10 };
#define KV_MEM (8u << 20)

static int32_t g_a[NA];
static int32_t g_ref[GEN];

/* Prompt A and its cold tokens, once. */
static void cold_ref(void) {
    static int done;
    if (done) return;
    h_prompt(g_a, NA, 4242);
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    ds_engine *cold = h_start(&o);
    h_run(cold, g_a, NA, GEN, g_ref);
    h_stop(cold);
    done = 1;
}

/* Runs A on e and checks its tokens and how deep it resumed. */
static ds_engine_stats run_a(ds_engine *e, int want_hit) {
    ds_engine_stats s0 = h_stats(e);
    int32_t out[GEN];
    h_run(e, g_a, NA, GEN, out);
    assert_memory_equal(out, g_ref, sizeof out);
    ds_engine_stats s1 = h_stats(e);
    if (want_hit >= 0)
        assert_int_equal(s1.prefix_hit_tokens - s0.prefix_hit_tokens, (uint64_t)want_hit);
    return s1;
}

/* Device pools too small to keep A: after six other prompts its pages and its checkpoints are
 * gone from the device, and the rerun loads them from RAM. */
static void test_ram_tier(void **st) {
    (void)st;
    cold_ref();
    ds_engine_opts o;
    h_opts(&o, 1, 600u << 10);
    o.state_checkpoint_memory = 2 * h_slot_bytes();
    o.kv_offload_ram_bytes = 32u << 20;
    ds_engine *e = h_start(&o);
    run_a(e, 0);
    for (int i = 0; i < 6; i++) {
        int32_t p[NA], out[GEN];
        h_prompt(p, NA, 50 + (uint64_t)i);
        h_run(e, p, NA, GEN, out);
    }
    ds_engine_stats s0 = h_stats(e);
    assert_true(s0.ckpt_evicted > 0);
    assert_true(s0.prefix_pages_evicted > 0);
    ds_engine_stats s = run_a(e, 96);
    print_message("ram: stores %llu, loads %llu\n", (unsigned long long)s.offload_stores,
                  (unsigned long long)s.offload_loads_ram);
    assert_true(s.offload_loads_ram > s0.offload_loads_ram);
    h_stop(e);
}

/* A second engine (nothing on its device) resumes A from files the first one wrote. */
static void test_disk_tier(void **st) {
    (void)st;
    cold_ref();
    char *dir = ds_test_tmpdir();
    ds_engine_opts o;
    h_opts(&o, 1, KV_MEM);
    o.kv_offload_disk_dir = dir;
    ds_engine *e = h_start(&o);
    ds_engine_stats s = run_a(e, 0);
    assert_true(s.offload_stores > 0);
    h_stop(e);
    e = h_start(&o);
    s = run_a(e, 96);
    assert_true(s.offload_loads_disk > 0);
    assert_int_equal(s.offload_bad, 0);
    h_stop(e);
    free(dir);
}

/* Flips bytes in the middle of every stored file: each is a counted miss (bad), A is recomputed
 * from scratch and still gives the cold tokens. */
static void test_disk_corrupt(void **st) {
    (void)st;
    cold_ref();
    char *dir = ds_test_tmpdir();
    ds_engine_opts o;
    h_opts(&o, 1, KV_MEM);
    o.kv_offload_disk_dir = dir;
    ds_engine *e = h_start(&o);
    run_a(e, 0);
    h_stop(e);
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n_files = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (!strstr(de->d_name, ".dsb")) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        FILE *f = fopen(path, "r+b");
        assert_non_null(f);
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, n / 2, SEEK_SET);
        int c = fgetc(f);
        fseek(f, n / 2, SEEK_SET);
        fputc(c ^ 0x5a, f);
        fclose(f);
        n_files++;
    }
    closedir(d);
    assert_true(n_files > 0);
    e = h_start(&o);
    ds_engine_stats s = run_a(e, 0);
    print_message("corrupt: %d files, bad %llu, misses %llu\n", n_files,
                  (unsigned long long)s.offload_bad, (unsigned long long)s.offload_misses);
    assert_true(s.offload_bad > 0);
    assert_int_equal(s.offload_loads_disk, 0);
    h_stop(e);
    free(dir);
}

/* ---- Redis ---------------------------------------------------------------------------------- */

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

/* Starts redis-server on a free port and waits until it answers PING. */
static pid_t start_redis(int *port) {
    *port = free_port();
    char ps[16];
    snprintf(ps, sizeof ps, "%d", *port);
    pid_t pid = fork();
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) {
            dup2(null, 1);
            dup2(null, 2);
        }
        execlp("redis-server", "redis-server", "--port", ps, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning", (char *)NULL);
        _exit(127);
    }
    assert_true(pid > 0);
    for (int i = 0; i < 100; i++) {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid)
            fail_msg("redis-server did not start (exit %d): is it installed?",
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        redisContext *c = redisConnect("127.0.0.1", *port);
        if (c && !c->err) {
            redisReply *r = redisCommand(c, "PING");
            int ok = r && r->type == REDIS_REPLY_STATUS;
            if (r) freeReplyObject(r);
            redisFree(c);
            if (ok) return pid;
        } else if (c) {
            redisFree(c);
        }
        usleep(50000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    fail_msg("redis-server did not answer on port %d", *port);
    return -1;
}

static void stop_redis(pid_t pid) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* One engine stores A in Redis; a fresh one resumes from it. */
static void test_redis_tier(void **st) {
    (void)st;
    cold_ref();
    int port;
    pid_t rp = start_redis(&port);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    ds_engine_opts o;
    h_opts(&o, 1, KV_MEM);
    o.kv_offload_remote = url;
    ds_engine *e = h_start(&o);
    ds_engine_stats s = run_a(e, 0);
    assert_true(s.offload_stores > 0);
    h_stop(e);
    e = h_start(&o);
    s = run_a(e, 96);
    assert_true(s.offload_loads_remote > 0);
    assert_int_equal(s.offload_remote_errors, 0);
    h_stop(e);
    stop_redis(rp);
}

/* Redis killed while requests run: they all finish with the cold tokens, and later ones too. */
static void test_redis_killed(void **st) {
    (void)st;
    cold_ref();
    enum { N = 6 };
    int32_t p[N][NA], ref[N][GEN];
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    ds_engine *cold = h_start(&o);
    for (int i = 0; i < N; i++) {
        h_prompt(p[i], NA, 900 + (uint64_t)i);
        h_run(cold, p[i], NA, GEN, ref[i]);
    }
    h_stop(cold);
    int port;
    pid_t rp = start_redis(&port);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    h_opts(&o, 1, KV_MEM);
    o.max_num_seqs = 2;
    o.kv_offload_remote = url;
    ds_engine *e = h_start(&o);
    h_req r[N];
    for (int i = 0; i < N; i++) h_submit(e, p[i], NA, GEN, &r[i]);
    h_wait(&r[0]);
    stop_redis(rp);
    for (int i = 0; i < N; i++) {
        h_wait(&r[i]);
        assert_int_equal(r[i].why[0], DS_FINISH_LENGTH);
        assert_memory_equal(r[i].tokens[0], ref[i], sizeof ref[i]);
    }
    ds_engine_stats s = run_a(e, 0);
    print_message("redis killed: remote errors %llu, stores %llu\n",
                  (unsigned long long)s.offload_remote_errors,
                  (unsigned long long)s.offload_stores);
    assert_true(s.offload_remote_errors > 0);
    h_stop(e);
}

/* Issue 30, case 3: two models of the same shape (tiny-k3 drawn from two seeds: the same
 * config.json, the same weight bytes, other values) share one disk folder and one Redis. The
 * second never loads the first's entries: it resumes from nothing and gives its own cold tokens.
 * Keyed by config and weight size, as before, it loaded them and answered with the first
 * model's continuation. */
static void test_two_models_share_tiers(void **st) {
    (void)st;
    cold_ref();
    char *tmp = ds_test_tmpdir(), other[4200], cfg_a[4300], cfg_b[4300];
    snprintf(other, sizeof other, "%s/other-k3", tmp);
    ds_err err = {{0}};
    if (ds_init_model("tiny-k3", other, 7, &err)) fail_msg("%s", err.msg);
    snprintf(cfg_a, sizeof cfg_a, "%s/config.json", h_model_dir());
    snprintf(cfg_b, sizeof cfg_b, "%s/config.json", other);
    size_t la = 0, lb = 0;
    char *a = ds_read_file(cfg_a, &la, NULL), *b = ds_read_file(cfg_b, &lb, NULL);
    assert_non_null(a);
    assert_non_null(b);
    assert_true(la == lb && memcmp(a, b, la) == 0); /* else this test would prove nothing */
    free(a);
    free(b);
    int port;
    pid_t rp = start_redis(&port);
    char url[64], dir[4200];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    snprintf(dir, sizeof dir, "%s/shared-tier", tmp);
    /* the other model's cold tokens for prompt A */
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    o.model_dir = other;
    ds_engine *cold = h_start(&o);
    int32_t ref_b[GEN], out[GEN];
    h_run(cold, g_a, NA, GEN, ref_b);
    h_stop(cold);
    assert_true(memcmp(ref_b, g_ref, sizeof ref_b) != 0); /* the two models differ on A */
    for (int tier = 0; tier < 2; tier++) {                /* disk, then Redis */
        h_opts(&o, 1, KV_MEM);
        if (tier == 0)
            o.kv_offload_disk_dir = dir;
        else
            o.kv_offload_remote = url;
        ds_engine *e = h_start(&o); /* the first model files A in the shared tier */
        ds_engine_stats s = run_a(e, 0);
        assert_true(s.offload_stores > 0);
        h_stop(e);
        o.model_dir = other;
        e = h_start(&o);
        h_run(e, g_a, NA, GEN, out);
        s = h_stats(e);
        print_message("second model (%s): hit %llu, loads %llu %llu\n", tier ? "redis" : "disk",
                      (unsigned long long)s.prefix_hit_tokens,
                      (unsigned long long)s.offload_loads_disk,
                      (unsigned long long)s.offload_loads_remote);
        assert_int_equal(s.prefix_hit_tokens, 0);
        assert_int_equal(s.offload_loads_disk + s.offload_loads_remote, 0);
        assert_memory_equal(out, ref_b, sizeof out);
        h_stop(e);
        /* and the first model still finds its own entries there */
        o.model_dir = h_model_dir();
        e = h_start(&o);
        s = run_a(e, 96);
        assert_true(s.offload_loads_disk + s.offload_loads_remote > 0);
        h_stop(e);
    }
    stop_redis(rp);
    free(tmp);
}

static size_t dir_bytes(const char *dir, int *n_tmp) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    size_t total = 0;
    *n_tmp = 0;
    for (struct dirent *de; (de = readdir(d));) {
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat sb;
        if (de->d_name[0] == '.' && strncmp(de->d_name, ".tmp-", 5) != 0) continue;
        if (strncmp(de->d_name, ".tmp-", 5) == 0) (*n_tmp)++;
        if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) total += (size_t)sb.st_size;
    }
    closedir(d);
    return total;
}

/* Issue 30, case 6: the disk tier's budget covers the folder across processes and restarts. A
 * folder already over budget (files an earlier process left, and a temporary file of a writer
 * that died) is trimmed at start-up; each of several engines in turn stays within the budget;
 * the newest entries survive. Before, each process counted only its own files, and the folder
 * grew past the budget with every restart. */
static void test_disk_budget_across_restarts(void **st) {
    (void)st;
    cold_ref();
    char *tmp = ds_test_tmpdir(), dir[4200], path[4400];
    snprintf(dir, sizeof dir, "%s/budget", tmp);
    assert_int_equal(mkdir(dir, 0755), 0);
    /* a dead writer's pid: a child that has exited */
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    snprintf(path, sizeof path, "%s/.tmp-%d-7", dir, (int)dead);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs("half a blob", f);
    fclose(f);
    char big[20000];
    memset(big, 'x', sizeof big);
    for (int i = 0; i < 8; i++) { /* 160 KB of old entries */
        snprintf(path, sizeof path, "%s/ds-old-%d.dsb", dir, i);
        f = fopen(path, "wb");
        assert_non_null(f);
        fwrite(big, 1, sizeof big, f);
        fclose(f);
        struct timespec ts[2] = {{1000000 + i, 0}, {1000000 + i, 0}};
        utimensat(AT_FDCWD, path, ts, 0);
    }
    const size_t budget = 64u << 10;
    int n_tmp;
    for (int run = 0; run < 3; run++) {
        ds_engine_opts o;
        h_opts(&o, 1, KV_MEM);
        o.kv_offload_disk_dir = dir;
        o.kv_offload_disk_bytes = budget;
        ds_engine *e = h_start(&o);
        size_t at_start = dir_bytes(dir, &n_tmp);
        assert_true(at_start <= budget);
        assert_int_equal(n_tmp, 0); /* the orphan is gone */
        for (int i = 0; i < 4; i++) {
            int32_t p[NA], out[GEN];
            h_prompt(p, NA, 7000 + (uint64_t)(run * 10 + i));
            h_run(e, p, NA, GEN, out);
        }
        ds_engine_stats s = h_stats(e);
        assert_true(s.offload_stores > 0);
        h_stop(e);
        size_t after = dir_bytes(dir, &n_tmp);
        print_message("disk budget run %d: %zu bytes at start, %zu after (budget %zu)\n", run,
                      at_start, after, budget);
        assert_true(after <= budget);
        assert_true(after > 0);
    }
    snprintf(path, sizeof path, "%s/ds-old-7.dsb", dir);
    assert_int_equal(access(path, F_OK), -1); /* the oldest went first */
    free(tmp);
}

/* A quantized latent cache (dtype dt) through the disk tier: a second engine of that dtype
 * resumes A from the first one's files with the cold engine's tokens. Then the cache dtype keeps
 * the entries apart: an engine of another dtype on the same folder finds none of them (no load,
 * nothing damaged), and a dt engine none of the other's. */
static void dtype_disk_tier(int dt, int other) {
    int32_t a[NA], ref8[GEN], out[GEN];
    h_prompt(a, NA, 4242);
    ds_engine_opts o;
    h_kv_dtype = dt;
    h_opts(&o, 0, KV_MEM);
    ds_engine *e = h_start(&o);
    h_run(e, a, NA, GEN, ref8);
    h_stop(e);
    char *dir = ds_test_tmpdir();
    h_opts(&o, 1, KV_MEM);
    o.kv_offload_disk_dir = dir;
    e = h_start(&o);
    h_run(e, a, NA, GEN, out);
    assert_memory_equal(out, ref8, sizeof out);
    assert_true(h_stats(e).offload_stores > 0);
    h_stop(e);
    e = h_start(&o);
    ds_engine_stats s0 = h_stats(e);
    h_run(e, a, NA, GEN, out);
    ds_engine_stats s1 = h_stats(e);
    assert_memory_equal(out, ref8, sizeof out);
    assert_int_equal(s1.prefix_hit_tokens - s0.prefix_hit_tokens, 96);
    assert_true(s1.offload_loads_disk > 0);
    assert_int_equal(s1.offload_bad, 0);
    h_stop(e);
    /* an engine of the other dtype on dt's files: its own cold tokens, no entry of dt read */
    int32_t ref_o[GEN];
    h_kv_dtype = other;
    h_opts(&o, 0, KV_MEM);
    e = h_start(&o);
    h_run(e, a, NA, GEN, ref_o);
    h_stop(e);
    h_opts(&o, 1, KV_MEM);
    o.kv_offload_disk_dir = dir;
    e = h_start(&o);
    h_run(e, a, NA, GEN, out);
    ds_engine_stats s = h_stats(e);
    assert_memory_equal(out, ref_o, sizeof out);
    assert_int_equal(s.prefix_hit_tokens, 0);
    assert_int_equal(s.offload_loads_disk, 0);
    assert_int_equal(s.offload_bad, 0);
    h_stop(e);
    /* and a dt engine on a folder holding both: its own entries only */
    h_kv_dtype = dt;
    h_opts(&o, 1, KV_MEM);
    o.kv_offload_disk_dir = dir;
    e = h_start(&o);
    s0 = h_stats(e);
    h_run(e, a, NA, GEN, out);
    s1 = h_stats(e);
    assert_memory_equal(out, ref8, sizeof out);
    assert_int_equal(s1.prefix_hit_tokens - s0.prefix_hit_tokens, 96);
    assert_int_equal(s1.offload_bad, 0);
    h_stop(e);
    h_kv_dtype = DS_KV_F32;
    free(dir);
}
static void test_fp8_disk_tier(void **st) {
    (void)st;
    dtype_disk_tier(DS_KV_FP8, DS_KV_F32);
}
/* BF16 rows beside FP8 ones (and, through cold_ref's f32 run in run_a's checks, the f32 tier's) */
static void test_bf16_disk_tier(void **st) {
    (void)st;
    dtype_disk_tier(DS_KV_BF16, DS_KV_FP8);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN); /* a write to a killed Redis must be an error, not a signal */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ram_tier),
        cmocka_unit_test(test_disk_tier),
        cmocka_unit_test(test_disk_corrupt),
        cmocka_unit_test(test_redis_tier),
        cmocka_unit_test(test_redis_killed),
        cmocka_unit_test(test_two_models_share_tiers),
        cmocka_unit_test(test_disk_budget_across_restarts),
        cmocka_unit_test(test_fp8_disk_tier),
        cmocka_unit_test(test_bf16_disk_tier),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
