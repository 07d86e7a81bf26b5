/* fuzzutil.c — see fuzzutil.h. */
#include "fuzzutil.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[512]; /* "" until made */
static char g_path[1024];

static void remove_dir(void) {
    DIR *d = opendir(g_dir);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (de->d_name[0] == '.' &&
                (!de->d_name[1] || (de->d_name[1] == '.' && !de->d_name[2])))
                continue;
            char p[1024];
            snprintf(p, sizeof p, "%s/%s", g_dir, de->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(g_dir);
}

const char *fz_dir(void) {
    if (g_dir[0]) return g_dir;
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/ds-fuzz-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) fz_fail("cannot make a temporary folder under %s", g_dir);
    atexit(remove_dir);
    return g_dir;
}

const char *fz_write(const char *name, const void *p, size_t n) {
    snprintf(g_path, sizeof g_path, "%s/%s", fz_dir(), name);
    int fd = open(g_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) fz_fail("cannot write %s", g_path);
    const uint8_t *q = p;
    while (n) {
        ssize_t k = write(fd, q, n);
        if (k <= 0) fz_fail("write to %s failed", g_path);
        q += k;
        n -= (size_t)k;
    }
    close(fd);
    return g_path;
}

void fz_remove(const char *name) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", fz_dir(), name);
    unlink(p);
}

int fz_split(const uint8_t *data, size_t size, const char *sep, const uint8_t **part, size_t *len,
             int max) {
    size_t m = strlen(sep);
    int n = 0;
    const uint8_t *p = data, *end = data + size;
    while (n < max - 1) {
        const uint8_t *q = memmem(p, (size_t)(end - p), sep, m);
        if (!q) break;
        part[n] = p;
        len[n++] = (size_t)(q - p);
        p = q + m;
    }
    part[n] = p;
    len[n++] = (size_t)(end - p);
    return n;
}

char *fz_strndup(const uint8_t *p, size_t n) {
    char *s = malloc(n + 1);
    if (!s) fz_fail("out of memory");
    if (n) memcpy(s, p, n);
    s[n] = 0;
    return s;
}

void fz_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz invariant failed: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

void fz_note(const char *what, int rc, const char *msg) {
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("DS_FUZZ_VERBOSE") != NULL;
    if (verbose) fprintf(stderr, "%s: %s\n", what, rc == 0 ? "ok" : msg);
}
