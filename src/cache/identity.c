/* identity.c — see identity.h. */
#include "cache/identity.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

static int name_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* Adds one file's name, size and bytes to the running digest. */
static int add_file(XXH3_state_t *st, const char *dir, const char *name, ds_err *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return ds_errf(err, "model identity: cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        close(fd);
        return ds_errf(err, "model identity: cannot stat %s: %s", path, strerror(errno));
    }
    uint64_t size = (uint64_t)sb.st_size;
    XXH3_128bits_update(st, name, strlen(name) + 1);
    XXH3_128bits_update(st, &size, sizeof size);
    if (size > 0) {
        void *p = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return ds_errf(err, "model identity: cannot map %s: %s", path, strerror(errno));
        }
        madvise(p, (size_t)size, MADV_SEQUENTIAL);
        XXH3_128bits_update(st, p, (size_t)size);
        munmap(p, (size_t)size);
    }
    close(fd);
    return DS_OK;
}

int ds_checkpoint_digest(const char *dir, uint64_t out[2], ds_err *err) {
    DIR *d = opendir(dir);
    if (!d) return ds_errf(err, "model identity: cannot read folder %s: %s", dir, strerror(errno));
    char **names = NULL; /* [n] config.json and *.safetensors */
    size_t n = 0, cap = 0;
    int rc = DS_OK;
    for (struct dirent *de; (de = readdir(d));) {
        if (strcmp(de->d_name, "config.json") != 0 && !ends_with(de->d_name, ".safetensors"))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn) {
                rc = ds_errf(err, "model identity: out of memory");
                break;
            }
            names = nn;
        }
        if (!(names[n] = strdup(de->d_name))) {
            rc = ds_errf(err, "model identity: out of memory");
            break;
        }
        n++;
    }
    closedir(d);
    XXH3_state_t *st = rc == DS_OK ? XXH3_createState() : NULL;
    if (rc == DS_OK && !st) rc = ds_errf(err, "model identity: out of memory");
    if (rc == DS_OK) {
        qsort(names, n, sizeof *names, name_cmp);
        XXH3_128bits_reset(st);
        for (size_t i = 0; i < n && rc == DS_OK; i++) rc = add_file(st, dir, names[i], err);
        if (rc == DS_OK && n == 0)
            rc = ds_errf(err, "model identity: %s has no config.json or .safetensors", dir);
        if (rc == DS_OK) {
            XXH128_hash_t h = XXH3_128bits_digest(st);
            out[0] = h.low64;
            out[1] = h.high64;
        }
    }
    XXH3_freeState(st);
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    return rc;
}

uint64_t ds_checkpoint_file_bytes(const char *dir) {
    uint64_t n = 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    for (struct dirent *de; (de = readdir(d));) {
        char path[4096];
        struct stat sb;
        if (!ends_with(de->d_name, ".safetensors")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (!stat(path, &sb)) n += (uint64_t)sb.st_size;
    }
    closedir(d);
    return n;
}
