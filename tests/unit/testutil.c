#include "testutil.h"

#include "base/ds_base.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

double ds_test_rel_err(const float *a, const double *b, size_t n) {
    double scale = 1e-30, err = 0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(b[i]));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= err)) err = d; /* NaN propagates as a failure */
    }
    return err / scale;
}

double ds_test_rel_err_f(const float *a, const float *b, size_t n) {
    double scale = 1e-30, err = 0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs((double)b[i]));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= err)) err = d;
    }
    return err / scale;
}

char *ds_test_tmpdir(void) {
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = "/tmp";
    char *p = malloc(strlen(base) + 32);
    sprintf(p, "%s/dstest.XXXXXX", base);
    if (!mkdtemp(p)) {
        free(p);
        return NULL;
    }
    return p;
}

int ds_test_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    fclose(f);
    return w == n ? 0 : -1;
}

int ds_test_copy_config(const char *from_dir, const char *to_dir) {
    char src[4200], dst[4200];
    snprintf(src, sizeof src, "%s/config.json", from_dir);
    snprintf(dst, sizeof dst, "%s/config.json", to_dir);
    size_t len;
    ds_err err = {{0}};
    char *cfg = ds_read_file(src, &len, &err);
    int rc = cfg ? ds_test_write_file(dst, cfg, len) : -1;
    free(cfg);
    return rc;
}

char *ds_test_src_path(const char *rel) {
    const char *base = getenv("DS_SOURCE_DIR");
    if (!base || !*base) base = ".";
    char *p = malloc(strlen(base) + strlen(rel) + 2);
    sprintf(p, "%s/%s", base, rel);
    return p;
}
