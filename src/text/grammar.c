/* grammar.c — llguidance behind grammar.h: the library loaded with dlopen, its tokenizer built
 * from ours, matchers cloned from a bounded LRU cache of compiled grammars.
 *
 * The declarations below are written here from llguidance's documented C ABI (parser/
 * llguidance.h of the llguidance repository, 1.x); only the fields and calls used are named.
 * Structs the library fills are given spare room, so a newer library with longer structs cannot
 * write past them. */
#include "text/grammar.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- llguidance's C ABI (the subset used) ---- */

typedef struct llg_tok llg_tok; /* LlgTokenizer */
typedef struct llg_mat llg_mat; /* LlgMatcher */

typedef struct llg_limits { /* LlgParserLimits; zero fields take the library's defaults */
    size_t max_items_in_row;
    uint64_t initial_lexer_fuel, step_lexer_fuel;
    size_t step_max_items, max_lexer_states, max_grammar_size;
    bool precompute_large_lexemes, verbose_errors;
} llg_limits;

typedef union llg_cinit { /* LlgConstraintInit, with room to spare */
    struct {
        const llg_tok *tokenizer;
        uint32_t log_buffer_level, log_stderr_level;
        bool ff_tokens_ok, backtrack_ok;
        llg_limits limits;
    } f;
    char room[512];
} llg_cinit;

typedef struct llg_tinit { /* LlgTokenizerInitV2: the library reads struct_size bytes of it */
    size_t struct_size;
    uint32_t vocab_size;
    uint32_t tok_eos;
    const uint32_t *token_lens; /* [vocab_size] */
    const uint8_t *token_bytes; /* [sum of token_lens] */
    const char *tokenizer_json; /* NULL: the two arrays above */
    bool tokenize_assumes_string;
    void *tokenize_fn;           /* NULL with use_approximate_greedy */
    bool use_approximate_greedy; /* we never ask llguidance to tokenize text of its own */
    const void *tokenize_user_data;
    const char *const *slices; /* NULL: the library's default partitions */
    const uint32_t *tok_eos_extra;
    uint32_t tok_eos_extra_count;
} llg_tinit;

static struct llg_api {
    llg_tok *(*new_tokenizer_v2)(const llg_tinit *, char *, size_t);
    void (*free_tokenizer)(llg_tok *);
    void (*init_defaults)(llg_cinit *, const llg_tok *);
    llg_mat *(*new_matcher)(const llg_cinit *, const char *, const char *);
    llg_mat *(*clone_matcher)(const llg_mat *);
    void (*free_matcher)(llg_mat *);
    const char *(*matcher_error)(llg_mat *);
    int32_t (*mask_into)(llg_mat *, uint32_t *, size_t);
    size_t (*mask_bytes)(const llg_mat *);
    int32_t (*consume)(llg_mat *, uint32_t);
    int32_t (*rollback)(llg_mat *, size_t);
    int32_t (*validate)(llg_mat *, const uint32_t *, size_t);
    bool (*is_stopped)(const llg_mat *);
} api;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static char load_error[1200]; /* empty once loaded */

/* Runs `python3` to find llguidance's library (and libpython, which it references) without
 * importing it. out_lib / out_py: [n] each. */
static int ask_python(char *out_lib, char *out_py, size_t n, ds_err *err) {
    static const char cmd[] = "python3 -c 'import importlib.util as u,glob,os,sysconfig as s;"
                              "p=u.find_spec(\"llguidance\");d=p.submodule_search_locations[0];"
                              "print((glob.glob(os.path.join(d,\"_lib*.so\"))+[\"\"])[0]);"
                              "print(os.path.join(s.get_config_var(\"LIBDIR\") or \"\","
                              "s.get_config_var(\"INSTSONAME\") or \"\"))' 2>/dev/null";
    FILE *p = popen(cmd, "r");
    if (!p) return ds_errf(err, "could not run python3 to find llguidance");
    out_lib[0] = out_py[0] = 0;
    if (fgets(out_lib, (int)n, p)) (void)!fgets(out_py, (int)n, p);
    int rc = pclose(p);
    out_lib[strcspn(out_lib, "\n")] = 0;
    out_py[strcspn(out_py, "\n")] = 0;
    if (rc != 0 || !out_lib[0])
        return ds_errf(err,
                       "the llguidance Python package is not installed for python3 "
                       "(pip install llguidance, or set DS_LLGUIDANCE_LIB to its _lib.abi3.so)");
    return DS_OK;
}

int ds_grammar_lib_path(char *out, size_t n, ds_err *err) {
    const char *env = getenv("DS_LLGUIDANCE_LIB");
    if (env && *env) {
        snprintf(out, n, "%s", env);
        return DS_OK;
    }
    char py[1024];
    char lib[1024];
    if (ask_python(lib, py, sizeof lib, err)) return DS_ERR;
    snprintf(out, n, "%s", lib);
    return DS_OK;
}

static void load_library(void) {
    ds_err err = {{0}};
    char lib[1024] = "", py[1024] = "";
    const char *env = getenv("DS_LLGUIDANCE_LIB");
    if (env && *env)
        snprintf(lib, sizeof lib, "%s", env);
    else if (ask_python(lib, py, sizeof lib, &err)) {
        snprintf(load_error, sizeof load_error, "%s", err.msg);
        return;
    }
    /* The wheel's library is a Python extension too: it references libpython's symbols, which
     * must be global before it loads (we never call into Python). */
    if (!py[0] || !dlopen(py, RTLD_NOW | RTLD_GLOBAL))
        (void)dlopen("libpython3.11.so.1.0", RTLD_NOW | RTLD_GLOBAL);
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(load_error, sizeof load_error, "cannot load llguidance from %s: %s", lib,
                 dlerror());
        return;
    }
    struct {
        const char *name;
        void **slot;
    } syms[] = {
        {"llg_new_tokenizer_v2", (void **)&api.new_tokenizer_v2},
        {"llg_free_tokenizer", (void **)&api.free_tokenizer},
        {"llg_constraint_init_set_defaults", (void **)&api.init_defaults},
        {"llg_new_matcher", (void **)&api.new_matcher},
        {"llg_clone_matcher", (void **)&api.clone_matcher},
        {"llg_free_matcher", (void **)&api.free_matcher},
        {"llg_matcher_get_error", (void **)&api.matcher_error},
        {"llg_matcher_compute_mask_into", (void **)&api.mask_into},
        {"llg_matcher_get_mask_byte_size", (void **)&api.mask_bytes},
        {"llg_matcher_consume_token", (void **)&api.consume},
        {"llg_matcher_rollback", (void **)&api.rollback},
        {"llg_matcher_validate_tokens", (void **)&api.validate},
        {"llg_matcher_is_stopped", (void **)&api.is_stopped},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(h, syms[i].name);
        if (!*syms[i].slot) {
            snprintf(load_error, sizeof load_error, "%s lacks %s (llguidance 1.x is needed)", lib,
                     syms[i].name);
            return;
        }
    }
    load_error[0] = 0;
}

/* ---- the tokenizer and the cache ---- */

typedef struct centry {
    char *key;     /* the grammar text; NULL: a free slot */
    uint64_t hash; /* FNV-1a of key */
    llg_mat *tmpl; /* compiled, at its start; only ever cloned */
    uint64_t used; /* LRU clock */
} centry;

/* A compile under way (on its compiling thread's stack), so that a second request for the same
 * grammar waits for it rather than compiling it again (single flight). */
typedef struct compiling {
    const char *key;
    uint64_t hash;
    struct compiling *next;
} compiling;

struct ds_grammars {
    llg_tok *tok;
    int vocab, words;
    int32_t eos;
    pthread_mutex_t mu;   /* guards the cache, the compiles under way and the stats */
    pthread_cond_t done;  /* a compile under way finished */
    compiling *under_way; /* list */
    centry *ents;         /* [cap] */
    int cap;
    uint64_t clock;
    ds_grammar_stats st;
};

struct ds_matcher {
    llg_mat *m;
    size_t mask_bytes;
    int32_t eos;
};

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* The vocabulary as llguidance reads it: lens[V], bytes concatenated; a special id's bytes are
 * 0xFF then its name, the library's mark for a token no text matches. */
static llg_tok *make_tokenizer(const ds_tokenizer *t, int32_t eos, ds_err *err) {
    int V = ds_tok_vocab_size(t), nr = ds_tok_n_ranks(t);
    size_t total = 0;
    for (int i = 0; i < V; i++) {
        size_t n = 0;
        (void)ds_tok_token_bytes(t, i, &n);
        total += n + (i >= nr);
    }
    uint32_t *lens = malloc((size_t)V * sizeof *lens); /* [V] */
    uint8_t *bytes = malloc(total ? total : 1);        /* [total] */
    if (!lens || !bytes) {
        free(lens), free(bytes);
        ds_errf(err, "grammar: out of memory for the vocabulary");
        return NULL;
    }
    size_t at = 0;
    for (int i = 0; i < V; i++) {
        size_t n = 0;
        const char *b = ds_tok_token_bytes(t, i, &n);
        if (i >= nr) bytes[at++] = 0xFF;
        if (n) memcpy(bytes + at, b, n);
        at += n;
        lens[i] = (uint32_t)(n + (i >= nr));
    }
    llg_tinit ti;
    memset(&ti, 0, sizeof ti);
    ti.struct_size = sizeof ti;
    ti.vocab_size = (uint32_t)V;
    ti.tok_eos = (uint32_t)eos;
    ti.token_lens = lens;
    ti.token_bytes = bytes;
    ti.use_approximate_greedy = true;
    char msg[512] = "";
    llg_tok *tok = api.new_tokenizer_v2(&ti, msg, sizeof msg);
    free(lens);
    free(bytes);
    if (!tok) ds_errf(err, "grammar: llguidance rejected the vocabulary: %s", msg);
    return tok;
}

int ds_grammars_new(const ds_tokenizer *t, int32_t eos, int cache_cap, ds_grammars **out,
                    ds_err *err) {
    *out = NULL;
    pthread_once(&load_once, load_library);
    if (load_error[0]) return ds_errf(err, "structured outputs are unavailable: %s", load_error);
    if (eos < 0 || eos >= ds_tok_vocab_size(t))
        return ds_errf(err, "grammar: eos id %d is outside the vocabulary", eos);
    ds_grammars *g = calloc(1, sizeof *g);
    if (!g) return ds_errf(err, "grammar: out of memory");
    g->cap = cache_cap < 1 ? 1 : cache_cap;
    g->ents = calloc((size_t)g->cap, sizeof *g->ents);
    g->tok = g->ents ? make_tokenizer(t, eos, err) : NULL;
    if (!g->tok) {
        if (!g->ents) ds_errf(err, "grammar: out of memory");
        free(g->ents);
        free(g);
        return DS_ERR;
    }
    g->vocab = ds_tok_vocab_size(t);
    g->words = (g->vocab + 31) / 32;
    g->eos = eos;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->done, NULL);
    *out = g;
    return DS_OK;
}

void ds_grammars_free(ds_grammars *g) {
    if (!g) return;
    for (int i = 0; i < g->cap; i++) {
        free(g->ents[i].key);
        if (g->ents[i].tmpl) api.free_matcher(g->ents[i].tmpl);
    }
    free(g->ents);
    api.free_tokenizer(g->tok);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->done);
    free(g);
}

int ds_grammars_mask_words(const ds_grammars *g) {
    return g->words;
}

/* From a millisecond (a small schema) to seconds (large nested schemas with many tools). */
const double ds_grammar_compile_bounds[DS_GRAMMAR_COMPILE_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0};

/* Counts one compile that took `seconds` (ok: it succeeded). Under g->mu. */
static void count_compile(ds_grammars *g, double seconds, int ok) {
    int b = 0;
    while (b < DS_GRAMMAR_COMPILE_BUCKETS && seconds > ds_grammar_compile_bounds[b]) b++;
    g->st.compile_buckets[b]++;
    g->st.compile_seconds += seconds;
    if (ok)
        g->st.compiles++;
    else
        g->st.compile_failures++;
}

/* A fresh compile of the Lark text (the cache's miss path; outside the lock: it can take ms). */
static llg_mat *compile(ds_grammars *g, const char *lark, ds_err *err) {
    llg_cinit ci;
    memset(&ci, 0, sizeof ci);
    api.init_defaults(&ci, g->tok);
    ci.f.log_stderr_level = 0; /* errors come back through ds_err, not on stderr */
    ci.f.log_buffer_level = 0;
    llg_mat *m = api.new_matcher(&ci, "lark", lark);
    const char *e = m ? api.matcher_error(m) : "out of memory";
    if (e) {
        ds_errf(err, "%s", e);
        if (m) api.free_matcher(m);
        return NULL;
    }
    return m;
}

/* The cache slot holding lark, or -1. Under g->mu. */
static int find(ds_grammars *g, const char *lark, uint64_t h) {
    for (int i = 0; i < g->cap; i++)
        if (g->ents[i].key && g->ents[i].hash == h && !strcmp(g->ents[i].key, lark)) return i;
    return -1;
}

/* A clone of the cached compile of lark (compiling and inserting it on a miss); with want == 0
 * only makes sure it is cached. */
static int get(ds_grammars *g, const char *lark, int want, llg_mat **out, ds_err *err) {
    uint64_t h = fnv1a(lark);
    pthread_mutex_lock(&g->mu);
    for (;;) {
        int i = find(g, lark, h);
        if (i >= 0) {
            g->st.hits++;
            g->ents[i].used = ++g->clock;
            *out = want ? api.clone_matcher(g->ents[i].tmpl) : NULL;
            pthread_mutex_unlock(&g->mu);
            return want && !*out ? ds_errf(err, "grammar: out of memory") : DS_OK;
        }
        const compiling *c = g->under_way;
        while (c && !(c->hash == h && !strcmp(c->key, lark))) c = c->next;
        if (!c) break;
        /* the same grammar is being compiled: its result is a hit (a failed one: compiled
         * again here, for this request's own error message) */
        pthread_cond_wait(&g->done, &g->mu);
    }
    compiling me = {lark, h, g->under_way};
    g->under_way = &me;
    pthread_mutex_unlock(&g->mu);
    double t0 = ds_now();
    llg_mat *m = compile(g, lark, err);
    double took = ds_now() - t0;
    char *key = m ? strdup(lark) : NULL;
    pthread_mutex_lock(&g->mu);
    for (compiling **p = &g->under_way; *p; p = &(*p)->next)
        if (*p == &me) {
            *p = me.next;
            break;
        }
    pthread_cond_broadcast(&g->done);
    count_compile(g, took, m != NULL);
    if (!m || !key) {
        pthread_mutex_unlock(&g->mu);
        if (m) api.free_matcher(m);
        return m ? ds_errf(err, "grammar: out of memory") : DS_ERR;
    }
    /* not cached (a compile of the same text waits for this one): a free slot, else the least
     * recently used */
    int i = 0;
    for (int j = 0; j < g->cap; j++) {
        if (!g->ents[j].key) {
            i = j;
            break;
        }
        if (g->ents[j].used < g->ents[i].used) i = j;
    }
    if (g->ents[i].key) {
        g->st.evictions++;
        free(g->ents[i].key);
        api.free_matcher(g->ents[i].tmpl);
    } else {
        g->st.entries++;
    }
    g->ents[i] = (centry){key, h, m, 0};
    g->ents[i].used = ++g->clock;
    *out = want ? api.clone_matcher(g->ents[i].tmpl) : NULL;
    pthread_mutex_unlock(&g->mu);
    return want && !*out ? ds_errf(err, "grammar: out of memory") : DS_OK;
}

int ds_grammar_check(ds_grammars *g, const char *lark, ds_err *err) {
    llg_mat *m = NULL;
    return get(g, lark, 0, &m, err);
}

int ds_matcher_new(ds_grammars *g, const char *lark, ds_matcher **out, ds_err *err) {
    *out = NULL;
    ds_matcher *dm = calloc(1, sizeof *dm);
    if (!dm) return ds_errf(err, "grammar: out of memory");
    if (get(g, lark, 1, &dm->m, err)) {
        free(dm);
        return DS_ERR;
    }
    dm->mask_bytes = api.mask_bytes(dm->m);
    dm->eos = g->eos;
    if (dm->mask_bytes != (size_t)g->words * 4) {
        size_t got = dm->mask_bytes;
        ds_matcher_free(dm);
        return ds_errf(err, "grammar: llguidance's mask has %zu bytes, expected %d", got,
                       g->words * 4);
    }
    *out = dm;
    return DS_OK;
}

void ds_matcher_free(ds_matcher *m) {
    if (!m) return;
    api.free_matcher(m->m);
    free(m);
}

static int matcher_err(ds_matcher *m, const char *what, ds_err *err) {
    const char *e = api.matcher_error(m->m);
    return ds_errf(err, "grammar: %s: %s", what, e ? e : "failed");
}

int ds_matcher_mask(ds_matcher *m, uint32_t *mask, ds_err *err) {
    if (api.mask_into(m->m, mask, m->mask_bytes)) return matcher_err(m, "mask", err);
    return DS_OK;
}

int ds_matcher_consume(ds_matcher *m, int32_t tok, ds_err *err) {
    /* the eos a complete grammar forces: llguidance has already stopped and takes nothing more */
    if (tok == m->eos && api.is_stopped(m->m)) return DS_OK;
    if (tok < 0 || api.consume(m->m, (uint32_t)tok)) return matcher_err(m, "token", err);
    return DS_OK;
}

int ds_matcher_rollback(ds_matcher *m, int n, ds_err *err) {
    if (n < 0 || api.rollback(m->m, (size_t)n)) return matcher_err(m, "rollback", err);
    return DS_OK;
}

int ds_matcher_validate(ds_matcher *m, const int32_t *toks, int n, ds_err *err) {
    if (n <= 0) return 0;
    int32_t k = api.validate(m->m, (const uint32_t *)toks, (size_t)n);
    if (k < 0) return matcher_err(m, "validate", err);
    return k;
}

int ds_matcher_done(const ds_matcher *m) {
    return api.is_stopped(m->m) ? 1 : 0;
}

void ds_grammars_stats(ds_grammars *g, ds_grammar_stats *s) {
    pthread_mutex_lock(&g->mu);
    *s = g->st;
    pthread_mutex_unlock(&g->mu);
    s->misses = s->compiles + s->compile_failures; /* every miss is one compile */
}
