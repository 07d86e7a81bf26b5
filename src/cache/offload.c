/* offload.c — the RAM / disk / Redis tiers behind the device pools.
 *
 * Every tier stores the same self-checking blob:
 *   blob_hdr | tokens [n_tokens] int32 | payload [n_floats] f32
 * The header names what the blob is (kind, hash, sizes, layout) and holds an XXH3-64 of the whole
 * blob computed with the checksum field zero. A get re-checks all of it and then compares the
 * stored tokens with the caller's prefix, so neither a damaged file nor a hash collision can ever
 * hand back another prefix's state: both are misses.
 *
 * RAM: a chained hash table of blobs with an LRU list, trimmed to ram_bytes.
 * Disk: one file per key, written to a temporary name and renamed into place, so a reader sees
 *       either nothing or a whole file. The budget covers the whole folder, across processes and
 *       restarts: at start-up (and every DISK_RESCAN puts, to see other processes' files) the
 *       folder is scanned, temporary files of processes that no longer run are removed, and the
 *       oldest files (by modification time; a load touches its file) are removed until the rest
 *       fit disk_bytes. A key already on disk is not written again (its contents are the same).
 * Redis: SET/GET of the blob under the key, with short timeouts. Any failure drops the
 *       connection and leaves the remote alone for REMOTE_BACKOFF_S, so a dead server costs the
 *       step loop at most one timeout per backoff period. */
#include "cache/offload.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define BLOB_MAGIC       0x31464f5344ull /* "DSOF1" */
#define BLOB_VERSION     1
#define REMOTE_BACKOFF_S 1.0
#define KEY_MAX          256
#define DISK_RESCAN      256 /* puts between scans of the disk folder */

typedef struct blob_hdr {
    uint64_t magic;
    uint32_t version, kind;
    uint32_t layout, n_tokens;
    uint64_t n_floats;
    uint64_t hash[2];
    uint64_t checksum; /* XXH3-64 of the blob with this field zero */
} blob_hdr;

typedef struct ram_node {
    char kind;
    uint64_t hash[2];
    uint8_t *blob;
    size_t size;
    struct ram_node *chain;       /* next in the bucket */
    struct ram_node *prev, *next; /* LRU: head = least recently used */
} ram_node;

typedef struct disk_file {
    char *path;
    size_t size;
    struct timespec mtime;
} disk_file;

struct ds_offload {
    ds_offload_opts o;
    char key_prefix[160]; /* model id, layers, rank, layout: shared by every key */
    /* RAM tier */
    ram_node **buckets; /* [n_buckets] */
    size_t n_buckets, ram_used;
    ram_node *lru_head, *lru_tail;
    /* disk tier: files written by this process, oldest first */
    char *disk_dir;
    disk_file *files;
    size_t n_files, cap_files, files_head, disk_used;
    uint64_t tmp_counter;
    uint64_t puts_since_scan;
    /* remote tier */
    char *host;
    int port;
    redisContext *rc;
    double retry_at;
    ds_offload_stats st;
};

/* ---- blobs --------------------------------------------------------------------------------- */

static uint8_t *blob_make(const ds_offload *o, char kind, const uint64_t hash[2],
                          const int32_t *tokens, int n_tokens, const void *data, size_t n_floats,
                          size_t *size) {
    size_t n = sizeof(blob_hdr) + (size_t)n_tokens * sizeof(int32_t) + n_floats * sizeof(float);
    uint8_t *b = malloc(n);
    if (!b) return NULL;
    blob_hdr h = {BLOB_MAGIC,         BLOB_VERSION, (uint32_t)kind,     (uint32_t)o->o.layout,
                  (uint32_t)n_tokens, n_floats,     {hash[0], hash[1]}, 0};
    memcpy(b, &h, sizeof h);
    memcpy(b + sizeof h, tokens, (size_t)n_tokens * sizeof(int32_t));
    memcpy(b + sizeof h + (size_t)n_tokens * sizeof(int32_t), data, n_floats * sizeof(float));
    h.checksum = XXH3_64bits(b, n);
    memcpy(b, &h, sizeof h);
    *size = n;
    return b;
}

/* 1 when the blob is intact and is exactly the entry asked for (payload copied to out); 0 when it
 * is damaged (counted bad) or belongs to another prefix (a collision: a plain miss). */
static int blob_check(ds_offload *o, const uint8_t *b, size_t size, char kind,
                      const uint64_t hash[2], const int32_t *tokens, int n_tokens, void *out,
                      size_t n_floats) {
    size_t want = sizeof(blob_hdr) + (size_t)n_tokens * sizeof(int32_t) + n_floats * sizeof(float);
    blob_hdr h;
    if (size < sizeof h) goto bad;
    memcpy(&h, b, sizeof h);
    uint64_t sum = h.checksum;
    if (h.magic != BLOB_MAGIC || h.version != BLOB_VERSION) goto bad;
    {
        /* checksum over the blob as written, with the checksum field zero */
        XXH3_state_t *xs = XXH3_createState();
        if (!xs) return 0;
        blob_hdr z = h;
        z.checksum = 0;
        XXH3_64bits_reset(xs);
        XXH3_64bits_update(xs, &z, sizeof z);
        XXH3_64bits_update(xs, b + sizeof h, size - sizeof h);
        uint64_t got = XXH3_64bits_digest(xs);
        XXH3_freeState(xs);
        if (got != sum) goto bad;
    }
    if (h.kind != (uint32_t)kind || h.layout != (uint32_t)o->o.layout || size != want ||
        h.n_tokens != (uint32_t)n_tokens || h.n_floats != n_floats || h.hash[0] != hash[0] ||
        h.hash[1] != hash[1])
        goto bad;
    if (memcmp(b + sizeof h, tokens, (size_t)n_tokens * sizeof(int32_t)) != 0)
        return 0; /* same hash, another prefix */
    memcpy(out, b + sizeof h + (size_t)n_tokens * sizeof(int32_t), n_floats * sizeof(float));
    return 1;
bad:
    o->st.bad++;
    return 0;
}

/* "<prefix>-<kind>-<hash hex>": safe as a file name and as a Redis key. */
static void make_key(const ds_offload *o, char kind, const uint64_t hash[2], char *key) {
    snprintf(key, KEY_MAX, "%s-%c-%016llx%016llx", o->key_prefix, kind, (unsigned long long)hash[1],
             (unsigned long long)hash[0]);
}

/* ---- RAM tier ------------------------------------------------------------------------------ */

static size_t bucket_of(const ds_offload *o, char kind, const uint64_t hash[2]) {
    return (size_t)((hash[0] ^ (uint64_t)(unsigned char)kind * 0x9e3779b97f4a7c15ull) %
                    o->n_buckets);
}

static void lru_unlink(ds_offload *o, ram_node *n) {
    if (n->prev)
        n->prev->next = n->next;
    else
        o->lru_head = n->next;
    if (n->next)
        n->next->prev = n->prev;
    else
        o->lru_tail = n->prev;
    n->prev = n->next = NULL;
}

static void lru_append(ds_offload *o, ram_node *n) {
    n->prev = o->lru_tail;
    n->next = NULL;
    if (o->lru_tail)
        o->lru_tail->next = n;
    else
        o->lru_head = n;
    o->lru_tail = n;
}

static ram_node **ram_find(ds_offload *o, char kind, const uint64_t hash[2]) {
    ram_node **p = &o->buckets[bucket_of(o, kind, hash)];
    for (; *p; p = &(*p)->chain)
        if ((*p)->kind == kind && (*p)->hash[0] == hash[0] && (*p)->hash[1] == hash[1]) return p;
    return p;
}

static void ram_drop(ds_offload *o, ram_node **at) {
    ram_node *n = *at;
    *at = n->chain;
    lru_unlink(o, n);
    o->ram_used -= n->size;
    free(n->blob);
    free(n);
}

/* Takes ownership of blob (frees it when it cannot be kept). */
static void ram_put(ds_offload *o, char kind, const uint64_t hash[2], uint8_t *blob, size_t size) {
    if (!o->buckets || size > o->o.ram_bytes) {
        free(blob);
        return;
    }
    ram_node **at = ram_find(o, kind, hash);
    if (*at) ram_drop(o, at);
    while (o->ram_used + size > o->o.ram_bytes && o->lru_head) {
        ram_node *victim = o->lru_head;
        ram_drop(o, ram_find(o, victim->kind, victim->hash));
    }
    ram_node *n = calloc(1, sizeof *n);
    if (!n) {
        free(blob);
        return;
    }
    n->kind = kind;
    n->hash[0] = hash[0];
    n->hash[1] = hash[1];
    n->blob = blob;
    n->size = size;
    at = &o->buckets[bucket_of(o, kind, hash)];
    n->chain = *at;
    *at = n;
    lru_append(o, n);
    o->ram_used += size;
}

/* ---- disk tier ----------------------------------------------------------------------------- */

static void disk_trim(ds_offload *o) {
    while (o->o.disk_bytes && o->disk_used > o->o.disk_bytes && o->files_head < o->n_files) {
        disk_file *f = &o->files[o->files_head++];
        unlink(f->path);
        o->disk_used -= f->size;
        free(f->path);
        f->path = NULL;
    }
    if (o->files_head > 0 && o->files_head * 2 >= o->n_files) { /* compact the FIFO */
        memmove(o->files, o->files + o->files_head,
                (o->n_files - o->files_head) * sizeof *o->files);
        o->n_files -= o->files_head;
        o->files_head = 0;
    }
}

static int mtime_cmp(const void *a, const void *b) {
    const disk_file *x = a, *y = b;
    if (x->mtime.tv_sec != y->mtime.tv_sec) return x->mtime.tv_sec < y->mtime.tv_sec ? -1 : 1;
    if (x->mtime.tv_nsec != y->mtime.tv_nsec) return x->mtime.tv_nsec < y->mtime.tv_nsec ? -1 : 1;
    return strcmp(x->path, y->path);
}

static void disk_forget(ds_offload *o) {
    for (size_t i = o->files_head; i < o->n_files; i++) free(o->files[i].path);
    o->n_files = o->files_head = 0;
    o->disk_used = 0;
}

/* Rebuilds the view of the folder from the folder itself: every entry file (ours, earlier
 * processes', concurrent ones'), oldest first; removes temporary files whose writer is gone. */
static void disk_scan(ds_offload *o) {
    DIR *d = opendir(o->disk_dir);
    if (!d) return;
    disk_forget(o);
    for (struct dirent *de; (de = readdir(d));) {
        const char *n = de->d_name;
        char path[1024];
        if (snprintf(path, sizeof path, "%s/%s", o->disk_dir, n) >= (int)sizeof path) continue;
        int pid;
        if (sscanf(n, ".tmp-%d-", &pid) == 1) {
            if (pid > 0 && pid != (int)getpid() && kill(pid, 0) != 0 && errno == ESRCH)
                unlink(path); /* orphaned by a process that died mid-write */
            continue;
        }
        size_t len = strlen(n);
        if (len < 5 || strcmp(n + len - 4, ".dsb") != 0) continue;
        struct stat sb;
        if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        if (o->n_files == o->cap_files) {
            size_t cap = o->cap_files ? 2 * o->cap_files : 64;
            disk_file *nf = realloc(o->files, cap * sizeof *nf);
            if (!nf) break;
            o->files = nf;
            o->cap_files = cap;
        }
        char *p = strdup(path);
        if (!p) break;
        o->files[o->n_files++] = (disk_file){p, (size_t)sb.st_size, sb.st_mtim};
        o->disk_used += (size_t)sb.st_size;
    }
    closedir(d);
    if (o->n_files > 1) qsort(o->files, o->n_files, sizeof *o->files, mtime_cmp);
    o->puts_since_scan = 0;
}

static void disk_put(ds_offload *o, const char *key, const uint8_t *blob, size_t size) {
    char path[1024], tmp[1100];
    snprintf(path, sizeof path, "%s/%s.dsb", o->disk_dir, key);
    /* already there (this or another process stored the same prefix): keep it, mark it used */
    if (utimensat(AT_FDCWD, path, NULL, 0) == 0) return;
    if (o->o.disk_bytes && ++o->puts_since_scan >= DISK_RESCAN) disk_scan(o);
    snprintf(tmp, sizeof tmp, "%s/.tmp-%d-%llu", o->disk_dir, (int)getpid(),
             (unsigned long long)o->tmp_counter++);
    FILE *f = fopen(tmp, "wb");
    if (!f) return;
    int ok = fwrite(blob, 1, size, f) == size;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return;
    }
    if (o->n_files == o->cap_files) {
        size_t cap = o->cap_files ? 2 * o->cap_files : 64;
        disk_file *nf = realloc(o->files, cap * sizeof *nf);
        if (!nf) return; /* the file stays, just outside the budget's view */
        o->files = nf;
        o->cap_files = cap;
    }
    char *p = strdup(path);
    if (!p) return;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    o->files[o->n_files++] = (disk_file){p, size, now};
    o->disk_used += size;
    disk_trim(o);
}

static uint8_t *disk_get(ds_offload *o, const char *key, size_t *size) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.dsb", o->disk_dir, key);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    uint8_t *b = NULL;
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && sb.st_size > 0 && (b = malloc((size_t)sb.st_size))) {
        if (fread(b, 1, (size_t)sb.st_size, f) != (size_t)sb.st_size) {
            free(b);
            b = NULL;
        } else {
            *size = (size_t)sb.st_size;
        }
    }
    fclose(f);
    if (b) utimensat(AT_FDCWD, path, NULL, 0); /* recently used: trimmed last */
    return b;
}

static void disk_drop(ds_offload *o, const char *key) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.dsb", o->disk_dir, key);
    unlink(path);
}

/* ---- remote tier --------------------------------------------------------------------------- */

static void remote_fail(ds_offload *o) {
    o->st.remote_errors++;
    if (o->rc) redisFree(o->rc);
    o->rc = NULL;
    o->retry_at = ds_now() + REMOTE_BACKOFF_S;
}

static int remote_ready(ds_offload *o) {
    if (!o->host) return 0;
    if (o->rc) return 1;
    if (ds_now() < o->retry_at) return 0;
    int ms = o->o.remote_timeout_ms > 0 ? o->o.remote_timeout_ms : 100;
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    o->rc = redisConnectWithTimeout(o->host, o->port, tv);
    if (!o->rc || o->rc->err || redisSetTimeout(o->rc, tv) != REDIS_OK) {
        remote_fail(o);
        return 0;
    }
    return 1;
}

static void remote_put(ds_offload *o, const char *key, const uint8_t *blob, size_t size) {
    if (!remote_ready(o)) return;
    redisReply *r = redisCommand(o->rc, "SET %b %b", key, strlen(key), blob, size);
    if (!r || r->type == REDIS_REPLY_ERROR) {
        if (r) freeReplyObject(r);
        remote_fail(o);
        return;
    }
    freeReplyObject(r);
}

static uint8_t *remote_get(ds_offload *o, const char *key, size_t *size) {
    if (!remote_ready(o)) return NULL;
    redisReply *r = redisCommand(o->rc, "GET %b", key, strlen(key));
    if (!r || r->type == REDIS_REPLY_ERROR) {
        if (r) freeReplyObject(r);
        remote_fail(o);
        return NULL;
    }
    uint8_t *b = NULL;
    if (r->type == REDIS_REPLY_STRING && r->len > 0 && (b = malloc(r->len))) {
        memcpy(b, r->str, r->len);
        *size = r->len;
    }
    freeReplyObject(r);
    return b;
}

static void remote_drop(ds_offload *o, const char *key) {
    if (!remote_ready(o)) return;
    redisReply *r = redisCommand(o->rc, "DEL %b", key, strlen(key));
    if (!r) {
        remote_fail(o);
        return;
    }
    freeReplyObject(r);
}

/* ---- public -------------------------------------------------------------------------------- */

int ds_offload_create(const ds_offload_opts *opts, ds_offload **out, ds_err *err) {
    *out = NULL;
    ds_offload *o = ds_calloc(1, sizeof *o, err);
    if (!o) return DS_ERR;
    o->o = *opts;
    o->o.disk_dir = o->o.remote = o->o.model_id = NULL; /* not kept: the caller's strings */
    snprintf(o->key_prefix, sizeof o->key_prefix, "ds-%s-L%d_%d-tp%d-v%d",
             opts->model_id ? opts->model_id : "model", opts->layer_lo, opts->layer_hi,
             opts->tp_rank, opts->layout);
    if (opts->ram_bytes) {
        o->n_buckets = 4096;
        o->buckets = ds_calloc(o->n_buckets, sizeof *o->buckets, err);
        if (!o->buckets) goto fail;
    }
    if (opts->disk_dir && opts->disk_dir[0]) {
        if (mkdir(opts->disk_dir, 0755) != 0 && errno != EEXIST) {
            ds_errf(err, "offload: cannot create disk tier folder %s: %s", opts->disk_dir,
                    strerror(errno));
            goto fail;
        }
        o->disk_dir = strdup(opts->disk_dir);
        if (!o->disk_dir) goto oom;
        disk_scan(o); /* what earlier processes left counts against the budget */
        disk_trim(o);
    }
    if (opts->remote && opts->remote[0]) {
        const char *r = opts->remote;
        if (strncmp(r, "redis://", 8) == 0) r += 8;
        const char *colon = strrchr(r, ':');
        o->port = 6379;
        size_t hl = colon ? (size_t)(colon - r) : strlen(r);
        if (colon) {
            char *end;
            long port = strtol(colon + 1, &end, 10);
            if (*end != '\0' && *end != '/') port = -1;
            if (port <= 0 || port > 65535) {
                ds_errf(err, "offload: bad remote address '%s' (want redis://host:port)",
                        opts->remote);
                goto fail;
            }
            o->port = (int)port;
        }
        if (hl == 0) {
            ds_errf(err, "offload: bad remote address '%s' (want redis://host:port)", opts->remote);
            goto fail;
        }
        o->host = strndup(r, hl);
        if (!o->host) goto oom;
    }
    *out = o;
    return DS_OK;
oom:
    ds_errf(err, "offload: out of memory");
fail:
    ds_offload_free(o);
    return DS_ERR;
}

void ds_offload_free(ds_offload *o) {
    if (!o) return;
    while (o->lru_head) ram_drop(o, ram_find(o, o->lru_head->kind, o->lru_head->hash));
    free(o->buckets);
    for (size_t i = o->files_head; i < o->n_files; i++) free(o->files[i].path);
    free(o->files);
    free(o->disk_dir);
    if (o->rc) redisFree(o->rc);
    free(o->host);
    free(o);
}

int ds_offload_enabled(const ds_offload *o) {
    return o && (o->buckets || o->disk_dir || o->host);
}

void ds_offload_put(ds_offload *o, char kind, const uint64_t hash[2], const int32_t *tokens,
                    int n_tokens, const void *data, size_t n_floats) {
    if (!ds_offload_enabled(o)) return;
    size_t size;
    uint8_t *blob = blob_make(o, kind, hash, tokens, n_tokens, data, n_floats, &size);
    if (!blob) return;
    char key[KEY_MAX];
    make_key(o, kind, hash, key);
    if (o->disk_dir) disk_put(o, key, blob, size);
    if (o->host) remote_put(o, key, blob, size);
    ram_put(o, kind, hash, blob, size); /* takes the blob */
    o->st.stores++;
}

int ds_offload_get(ds_offload *o, char kind, const uint64_t hash[2], const int32_t *tokens,
                   int n_tokens, void *out, size_t n_floats) {
    if (!ds_offload_enabled(o)) return 0;
    if (o->buckets) {
        ram_node **at = ram_find(o, kind, hash);
        if (*at) {
            ram_node *n = *at;
            uint64_t bad0 = o->st.bad;
            if (blob_check(o, n->blob, n->size, kind, hash, tokens, n_tokens, out, n_floats)) {
                lru_unlink(o, n);
                lru_append(o, n);
                o->st.loads_ram++;
                return 1;
            }
            if (o->st.bad != bad0) ram_drop(o, at);
        }
    }
    char key[KEY_MAX];
    make_key(o, kind, hash, key);
    for (int tier = 0; tier < 2; tier++) {
        size_t size = 0;
        uint8_t *b =
            tier == 0 ? (o->disk_dir ? disk_get(o, key, &size) : NULL) : remote_get(o, key, &size);
        if (!b) continue;
        uint64_t bad0 = o->st.bad;
        if (blob_check(o, b, size, kind, hash, tokens, n_tokens, out, n_floats)) {
            if (tier == 0)
                o->st.loads_disk++;
            else
                o->st.loads_remote++;
            ram_put(o, kind, hash, b, size); /* promote; takes the blob */
            return 1;
        }
        free(b);
        if (o->st.bad != bad0) { /* damaged: remove it so it is not read again */
            if (tier == 0)
                disk_drop(o, key);
            else
                remote_drop(o, key);
        }
    }
    o->st.misses++;
    return 0;
}

void ds_offload_get_stats(const ds_offload *o, ds_offload_stats *s) {
    if (!o) {
        memset(s, 0, sizeof *s);
        return;
    }
    *s = o->st;
}
