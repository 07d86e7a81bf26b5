/* http.c — the HTTP layer: routing, authentication, body limits, and the bridge between a
 * connection thread and the engine thread.
 *
 * libmicrohttpd runs one thread per connection, so a handler may block. A generation request
 * (gen_req) is submitted to the engine, whose event callback copies each event into the request's
 * queue (mutex + condvar) and returns at once; the connection thread drains the queue — all of it
 * at the end for a plain response, chunk by chunk from the stream reader for SSE.
 *
 * Who frees a gen_req: it is reference-counted, one reference each for
 *   - the connection (dropped when MHD reports the request completed, however it ended),
 *   - the engine (dropped by the callback after the last choice's final event; the engine promises
 *     exactly one final event per choice and no call after it),
 *   - the streaming response (dropped when MHD destroys the response).
 * A client that goes away (a failed write, or a hang-up noticed while waiting) aborts its engine
 * request at once; its later events are dropped, and the gen_req lives until the final events.
 *
 * Waiting never blocks forever on a dead client: waits wake every POLL_MS to look at the socket
 * for a hang-up (POLLRDHUP), which is how a non-streaming request notices a disconnect and how a
 * stream notices one while the request is still queued and nothing is written. */
#include "server/http.h"

#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "text/chat.h"
#include "server/edges.h"
#include "server/gate.h"
#include "server/kvparams.h"
#include "server/metrics.h"
#include "server/openai.h"

enum {
    POLL_MS = 100,            /* how often a waiting thread looks for a client hang-up */
    STREAM_BLOCK = 16 * 1024, /* MHD's buffer for a streamed response */
    HARD_BODY_FACTOR = 4,     /* bodies above factor * max_body are refused without reading */
    CONN_RESERVE = 64,        /* connections past max_connections that MHD still accepts, so
                                 they get a 503 rather than a reset */
    MHD_MEMORY = 64 * 1024,   /* MHD's memory per connection (head, fields, response head) */
};

struct ds_server {
    struct MHD_Daemon *mhd;
    _Atomic(ds_engine *) engine; /* NULL while the model loads */
    atomic_int quiesced;
    ds_gate *gate;    /* the listen socket, the connection table, deadlines (gate.h) */
    char *api_key;    /* or NULL */
    char *model_name; /* served name */
    size_t max_body;
    double retry_after;
    int max_conns;          /* beyond it requests get 503 (MHD resets past + CONN_RESERVE) */
    size_t max_inflight;    /* body bytes buffered over all requests at most */
    atomic_size_t inflight; /* body bytes reserved by requests being read or served */
    double keepalive_s;     /* a waiting stream writes an SSE comment this often */
    ds_metrics *metrics;
    pthread_mutex_t active_mu; /* guards n_active */
    pthread_cond_t active_cv;  /* signalled when n_active drops */
    int n_active;              /* generation requests whose connection has not completed */
    atomic_ullong next_id;
    uint64_t id_salt; /* differs per process so response ids do not repeat across restarts */
};

/* ---------------------------------------------------------------------------------------------
 * a generation request shared by the connection thread and the engine thread */

typedef struct qev {
    struct qev *next;
    ds_oai_event ev; /* ev.text points at text[] */
    char text[];
} qev;

typedef enum { ST_START = 0, ST_EVENTS, ST_FLUSH_END, ST_END } stream_state;

typedef struct gen_req {
    pthread_mutex_t mu; /* guards refs, the queue, n_final, gone, id */
    pthread_cond_t cv;  /* signalled on every queued event */
    int refs;
    ds_server *srv;
    ds_engine *e;
    int64_t id; /* engine id; 0 until submit returned */
    int gone;   /* the client is gone: events are dropped, the request aborted */
    qev *head, *tail;
    int n_choices, n_final;
    int oom; /* an event could not be queued: the response is an error */

    int n_prompt;
    ds_oai_request oai; /* owns the stop strings the engine reads until the last final event */
    ds_oai_resp_ctx ctx;
    char id_str[48];
    int fd;             /* client socket (for hang-up checks) */
    double t_hup_check; /* connection thread: when the socket was last looked at */

    /* engine thread only: metric timestamps */
    double t_arrival;
    double *t_last; /* [n_choices] time of the choice's last token, 0 before its first */
    int got_first;

    /* connection thread only: the stream being written */
    ds_oai_choice *choices; /* [n_choices] */
    stream_state st;
    char *out; /* [out_len] SSE bytes not yet handed to MHD, from out_pos */
    size_t out_len, out_pos, out_cap;
} gen_req;

static void gen_free(gen_req *r) {
    for (qev *q = r->head, *nx; q; q = nx) nx = q->next, free(q);
    for (int i = 0; r->choices && i < r->n_choices; i++) ds_oai_choice_free(&r->choices[i]);
    free(r->choices);
    free(r->t_last);
    free(r->out);
    ds_oai_request_free(&r->oai);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static void gen_unref(gen_req *r) {
    pthread_mutex_lock(&r->mu);
    int last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (last) gen_free(r);
}

/* Marks the client gone and aborts the engine request if it is still running. Idempotent. */
static void gen_abandon(gen_req *r) {
    pthread_mutex_lock(&r->mu);
    int64_t id = r->n_final < r->n_choices && !r->gone ? r->id : 0;
    r->gone = 1;
    for (qev *q = r->head, *nx; q; q = nx) nx = q->next, free(q);
    r->head = r->tail = NULL;
    pthread_mutex_unlock(&r->mu);
    if (id > 0) ds_engine_abort(r->e, id);
}

/* The engine's event callback (engine thread): time it, copy it, signal. Nothing here blocks
 * for long: one malloc, one memcpy, a few additions under two short-held mutexes. */
static void on_event(void *user, const ds_token_event *ev) {
    gen_req *r = user;
    double now = ds_now();
    ds_metrics *m = r->srv->metrics;
    if (ev->token >= 0 && ev->index >= 0 && ev->index < r->n_choices) {
        if (!r->got_first) {
            ds_metrics_observe(m, DS_HIST_TTFT, now - r->t_arrival);
            r->got_first = 1;
        } else if (r->t_last[ev->index] > 0) {
            ds_metrics_observe(m, DS_HIST_ITL, now - r->t_last[ev->index]);
        }
        r->t_last[ev->index] = now;
    }
    pthread_mutex_lock(&r->mu);
    if (!r->gone) {
        qev *q = malloc(sizeof *q + ev->text_len + 1);
        if (q) {
            int n_top = DS_MAX(0, DS_MIN(ev->n_top, DS_MAX_LOGPROBS));
            q->next = NULL;
            q->ev = (ds_oai_event){.index = ev->index,
                                   .token = ev->token,
                                   .logprob = ev->logprob,
                                   .n_top = n_top,
                                   .finish = ev->finish,
                                   .n_prompt = ev->n_prompt,
                                   .n_generated = ev->n_generated,
                                   .text = q->text,
                                   .text_len = ev->text_len};
            if (n_top) {
                memcpy(q->ev.top_ids, ev->top_ids, (size_t)n_top * sizeof(int32_t));
                memcpy(q->ev.top_logprobs, ev->top_logprobs, (size_t)n_top * sizeof(float));
            }
            if (ev->text_len) memcpy(q->text, ev->text, ev->text_len);
            q->text[ev->text_len] = 0;
            if (r->tail)
                r->tail->next = q;
            else
                r->head = q;
            r->tail = q;
        } else {
            r->oom = 1;
        }
    }
    int last = 0;
    if (ev->finish != DS_FINISH_NONE) last = ++r->n_final == r->n_choices;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (last) {
        ds_metrics_observe(m, DS_HIST_E2E, now - r->t_arrival);
        gen_unref(r); /* the engine's reference: it never calls us again for this request */
    }
}

/* 1 if the client closed its end of the socket (or the socket failed). */
static int client_hung_up(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return 0;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* Waits (mu held) until an event is queued or every final event arrived, or (wake_by > 0) until
 * then: returns 1 at wake_by with nothing queued. Returns DS_ERR when the client hung up (mu still
 * held). The socket is looked at every POLL_MS whether or not events flow: a plain request is
 * busy with events all the time and would otherwise never notice. */
static int gen_wait(gen_req *r, double wake_by) {
    for (;;) {
        double now = ds_now();
        if (wake_by > 0 && now >= wake_by && !r->head && r->n_final < r->n_choices) return 1;
        /* only while the engine still works for it: a finished answer is simply written */
        if (r->n_final < r->n_choices && now - r->t_hup_check >= POLL_MS * 1e-3) {
            r->t_hup_check = now;
            if (client_hung_up(r->fd)) return DS_ERR;
        }
        if (r->head || r->n_final >= r->n_choices) return DS_OK;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += POLL_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
}

/* ---------------------------------------------------------------------------------------------
 * responses */

static enum MHD_Result send_buf(struct MHD_Connection *c, unsigned status, char *body, size_t len,
                                const char *ctype) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(
        len, body ? body : (char *)"", body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    if (ctype) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_json(struct MHD_Connection *c, unsigned status, json_t *j) {
    char *s = ds_oai_dumps(j);
    if (!s) return send_buf(c, 500, NULL, 0, NULL);
    return send_buf(c, status, s, strlen(s), "application/json");
}

/* An OpenAI error response; extra_header/value may add one header (Allow, Retry-After, ...). */
static enum MHD_Result send_error_h(struct MHD_Connection *c, const ds_oai_error *e,
                                    const char *extra_header, const char *extra_value) {
    char *s = ds_oai_error_json(e);
    struct MHD_Response *resp = MHD_create_response_from_buffer(
        s ? strlen(s) : 0, s ? s : (char *)"", s ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        free(s);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (extra_header) MHD_add_response_header(resp, extra_header, extra_value);
    if (e->status == 401) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    /* a refusal for want of room frees its connection too */
    if (e->status == 503 && strcmp(e->code, "queue_full"))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    if ((e->status == 503 && strcmp(e->code, "queue_full")) ||
        (extra_header && strcmp(extra_header, MHD_HTTP_HEADER_CONNECTION) == 0))
        ds_gate_untracked(c); /* closing: no next head to look at */
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)e->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_error(struct MHD_Connection *c, const ds_oai_error *e) {
    return send_error_h(c, e, NULL, NULL);
}

__attribute__((format(printf, 5, 6))) static enum MHD_Result
send_errorf(struct MHD_Connection *c, int status, const char *param, const char *code,
            const char *fmt, ...) {
    ds_oai_error e;
    ds_oai_errorf(&e, status, param, code, "%s", "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    return send_error(c, &e);
}

/* ---------------------------------------------------------------------------------------------
 * streaming */

static int out_append(gen_req *r, const char *s, size_t n) {
    if (r->out_len + n > r->out_cap) {
        size_t cap = DS_MAX(2 * r->out_cap, r->out_len + n + 256);
        char *o = realloc(r->out, cap);
        if (!o) return DS_ERR;
        r->out = o, r->out_cap = cap;
    }
    memcpy(r->out + r->out_len, s, n);
    r->out_len += n;
    return DS_OK;
}

/* Appends "data: <json>\n\n" for j (stolen; NULL appends nothing). */
static int out_sse(gen_req *r, json_t *j) {
    if (!j) return DS_OK;
    size_t n;
    char *s = ds_oai_sse(j, &n);
    if (!s) return DS_ERR;
    int rc = out_append(r, s, n);
    free(s);
    return rc;
}

/* Produces the next SSE bytes into r->out, blocking until there are some. DS_ERR: stop the stream
 * (the client hung up, or out of memory). */
static int stream_fill(gen_req *r) {
    const ds_oai_resp_ctx *c = &r->ctx;
    if (r->st == ST_START) {
        r->st = ST_EVENTS;
        if (c->kind == DS_OAI_CHAT) /* the role comes first, before any token is ready */
            for (int i = 0; i < r->n_choices; i++)
                if (out_sse(r, ds_oai_chunk_role(c, i))) return DS_ERR;
        if (r->out_len) return DS_OK;
    }
    if (r->st == ST_FLUSH_END) {
        r->st = ST_END;
        return DS_OK;
    }
    pthread_mutex_lock(&r->mu);
    /* a stream that waits (queued, a long prefill) writes an SSE comment now and then, so the
     * idle timeout (and a proxy's) does not cut it */
    int w = gen_wait(r, ds_now() + r->srv->keepalive_s);
    if (w == 1) {
        pthread_mutex_unlock(&r->mu);
        return out_append(r, ": keep-alive\n\n", 14);
    }
    if (w) {
        pthread_mutex_unlock(&r->mu);
        gen_abandon(r);
        return DS_ERR;
    }
    qev *list = r->head;
    r->head = r->tail = NULL;
    /* every final event is queued before n_final counts it, so the list holds them all */
    int done = r->n_final == r->n_choices, oom = r->oom;
    pthread_mutex_unlock(&r->mu);

    int rc = DS_OK;
    for (qev *q = list, *nx; q; q = nx) {
        nx = q->next;
        int i = q->ev.index;
        if (rc == DS_OK && i >= 0 && i < r->n_choices) {
            json_t *j = ds_oai_chunk(c, &r->choices[i], &q->ev);
            /* a producer's streamed answer carries kv_transfer_params in the chunk that ends a
             * choice (vLLM's place for them); the transfer is filed before that final event */
            if (j && q->ev.finish != DS_FINISH_NONE)
                ds_kv_annotate(r->e, &r->oai,
                               json_is_array(j) ? json_array_get(j, json_array_size(j) - 1) : j);
            rc = out_sse(r, j);
        }
        free(q);
    }
    if (rc || oom) return DS_ERR;
    if (done) {
        if (r->oai.include_usage) {
            int n_completion = 0;
            for (int i = 0; i < r->n_choices; i++) n_completion += r->choices[i].n_generated;
            if (out_sse(r, ds_oai_chunk_usage(c, r->n_prompt, n_completion))) return DS_ERR;
        }
        if (out_append(r, "data: [DONE]\n\n", 14)) return DS_ERR;
        r->st = ST_FLUSH_END;
    }
    return DS_OK;
}

/* MHD's content reader for SSE (connection thread). Blocks until there is something to write;
 * never returns 0 (MHD would spin on it in thread-per-connection mode). */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    gen_req *r = cls;
    for (;;) {
        if (r->out_pos < r->out_len) {
            size_t n = DS_MIN(max, r->out_len - r->out_pos);
            memcpy(buf, r->out + r->out_pos, n);
            r->out_pos += n;
            return (ssize_t)n;
        }
        r->out_pos = r->out_len = 0;
        if (r->st == ST_END) return MHD_CONTENT_READER_END_OF_STREAM;
        if (stream_fill(r)) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

static void stream_free(void *cls) {
    gen_unref(cls);
}

/* ---------------------------------------------------------------------------------------------
 * generation endpoints */

typedef struct conn_ctx {
    char *body; /* [len] request body, NUL-terminated when complete */
    size_t len, cap;
    size_t seen;     /* bytes received, also beyond the limit (they are discarded) */
    size_t reserved; /* bytes of s->inflight this request holds (its body's room) */
    int no_room;     /* a chunked body outgrew s->max_inflight: discarded, answered 503 */
    gen_req *gen;    /* the generation this request started, or NULL */
    unsigned long long declared; /* its Content-Length (0: none) */
    int whole;                   /* the request was read whole (and dispatched) */
} conn_ctx;

static ds_engine *ready_engine(ds_server *s) {
    ds_engine *e = atomic_load(&s->engine);
    return e && !atomic_load(&s->quiesced) ? e : NULL;
}

static enum MHD_Result not_ready(ds_server *s, struct MHD_Connection *c) {
    if (atomic_load(&s->quiesced))
        return send_errorf(c, 503, NULL, "shutting_down", "the server is shutting down");
    return send_errorf(c, 503, NULL, "model_loading", "the model is still loading; retry shortly");
}

/* Renders / encodes the request's prompt into *ids [*n] (malloc'd). Errors are 400s. */
static int build_prompt(ds_engine *e, const ds_oai_request *q, int32_t **ids, int *n,
                        ds_oai_error *oe) {
    const ds_tokenizer *tok = ds_engine_tokenizer(e);
    ds_err err = {{0}};
    *ids = NULL;
    *n = 0;
    if (q->kind == DS_OAI_CHAT) {
        ds_chat_opts o;
        ds_chat_opts_default(&o);
        o.add_generation_prompt = q->add_generation_prompt;
        o.thinking = q->thinking;
        o.thinking_effort = q->thinking_effort;
        o.tool_choice = q->tool_choice;
        o.response_format_json = q->response_format_json;
        if (ds_chat_render(tok, (ds_chat_format)ds_engine_chat_format(e), q->messages_json,
                           q->tools_json, &o, ids, n, &err))
            return ds_oai_errorf(oe, 400, "messages", "invalid_value", "messages: %s", err.msg);
        return DS_OK;
    }
    if (q->prompt_ids) {
        *ids = malloc(((size_t)q->n_prompt_ids + 1) * sizeof(int32_t));
        if (!*ids) return ds_oai_errorf(oe, 500, NULL, NULL, "out of memory");
        memcpy(*ids, q->prompt_ids, (size_t)q->n_prompt_ids * sizeof(int32_t));
        *n = q->n_prompt_ids;
        return DS_OK;
    }
    /* special-token strings in a raw prompt become their ids, as Kimi's tokenizer does by
     * default, so a client can write a chat prompt by hand */
    if (ds_tok_encode(tok, q->prompt, q->prompt_len, 1, ids, n, &err)) {
        free(*ids);
        *ids = NULL;
        return ds_oai_errorf(oe, 400, "prompt", "invalid_value", "prompt: %s", err.msg);
    }
    return DS_OK;
}

static void make_id(ds_server *s, ds_oai_kind kind, char *out, size_t n) {
    uint64_t x = atomic_fetch_add(&s->next_id, 1) + s->id_salt;
    x ^= x >> 31, x *= 0x7fb5d329728ea185ull, x ^= x >> 27; /* scramble: ids look random */
    snprintf(out, n, "%s-%016llx", kind == DS_OAI_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)x);
}

/* Waits for all of a non-streaming request's events and answers. Events are folded into the
 * choices as they come, so the queue stays short however long the completion. */
static enum MHD_Result finish_plain(struct MHD_Connection *c, gen_req *r) {
    int oom = 0, done = 0;
    while (!done) {
        pthread_mutex_lock(&r->mu);
        if (gen_wait(r, 0)) {
            pthread_mutex_unlock(&r->mu);
            gen_abandon(r);
            return MHD_NO; /* nobody to answer: close the connection */
        }
        qev *list = r->head;
        r->head = r->tail = NULL;
        done = r->n_final == r->n_choices; /* finals are queued before they are counted */
        oom |= r->oom;
        pthread_mutex_unlock(&r->mu);
        for (qev *q = list, *nx; q; q = nx) {
            nx = q->next;
            ds_err err;
            if (q->ev.index >= 0 && q->ev.index < r->n_choices &&
                ds_oai_choice_add(&r->ctx, &r->choices[q->ev.index], &q->ev, &err))
                oom = 1;
            free(q);
        }
    }
    if (oom) return send_errorf(c, 500, NULL, NULL, "out of memory building the response");
    for (int i = 0; i < r->n_choices; i++) {
        if (r->choices[i].finish == DS_FINISH_ERROR)
            return send_errorf(c, 500, NULL, "engine_error", "the engine failed this request");
        if (r->choices[i].finish == DS_FINISH_ABORT)
            return send_errorf(c, 503, NULL, "aborted",
                               "the request was aborted (the server is shutting down)");
    }
    json_t *j = ds_oai_response(&r->ctx, r->choices, r->n_choices, r->n_prompt);
    return send_json(c, 200, ds_kv_annotate(r->e, &r->oai, j));
}

static enum MHD_Result handle_generate(ds_server *s, struct MHD_Connection *c, conn_ctx *cc,
                                       ds_oai_kind kind) {
    ds_engine *e = ready_engine(s);
    if (!e) return not_ready(s, c);
    double t_arrival = ds_now();
    const ds_tokenizer *tok = ds_engine_tokenizer(e);
    ds_oai_error oe;
    gen_req *r = calloc(1, sizeof *r);
    if (!r) return send_errorf(c, 500, NULL, NULL, "out of memory");
    if (ds_oai_parse_request(kind, cc->body, cc->len, s->model_name, ds_tok_vocab_size(tok),
                             &r->oai, &oe)) {
        free(r);
        return send_error(c, &oe);
    }
    int32_t *ids = NULL; /* [n_prompt] */
    int n_prompt = 0;
    if (build_prompt(e, &r->oai, &ids, &n_prompt, &oe) || ds_oai_build_grammar(e, &r->oai, &oe) ||
        ds_oai_fit_context(&r->oai, n_prompt, ds_engine_max_model_len(e), &oe)) {
        free(ids);
        ds_oai_request_free(&r->oai);
        free(r);
        return send_error(c, &oe);
    }

    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    r->srv = s;
    r->e = e;
    r->n_choices = r->oai.params.n;
    r->n_prompt = n_prompt;
    r->t_arrival = t_arrival;
    r->refs = 2; /* connection + engine */
    make_id(s, kind, r->id_str, sizeof r->id_str);
    r->ctx = (ds_oai_resp_ctx){.kind = kind,
                               .id = r->id_str,
                               .model = s->model_name,
                               .created = (long long)time(NULL),
                               .logprobs = r->oai.params.logprobs,
                               .tok = tok,
                               .keep_special = !r->oai.params.skip_special_tokens,
                               .token_ids = r->oai.return_token_ids};
    ds_oai_parse_opts(&r->ctx, &r->oai, ds_engine_chat_format(e));
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    r->fd = ci ? ci->connect_fd : -1;
    r->t_last = calloc((size_t)r->n_choices, sizeof(double));
    r->choices = calloc((size_t)r->n_choices, sizeof(ds_oai_choice));
    if (!r->t_last || !r->choices) {
        free(ids);
        gen_free(r);
        return send_errorf(c, 500, NULL, NULL, "out of memory");
    }
    cc->gen = r; /* from here the connection's reference is dropped by on_completed */
    pthread_mutex_lock(&s->active_mu);
    s->n_active++;
    pthread_mutex_unlock(&s->active_mu);
    ds_request_spec spec = ds_kv_spec(e, &r->oai, ids, n_prompt, on_event, r);
    int why = 0;
    ds_err err = {{0}};
    /* events may start (even finish) on the engine thread before submit returns */
    int64_t id = ds_engine_submit(e, &spec, &why, &err);
    free(ids);
    if (id <= 0) {
        pthread_mutex_lock(&r->mu);
        r->refs--; /* no events will come: drop the engine's reference (the connection's holds) */
        r->n_final = r->n_choices;
        pthread_mutex_unlock(&r->mu);
        if (why == DS_SUBMIT_FULL) {
            char ra[32];
            snprintf(ra, sizeof ra, "%d", (int)(s->retry_after + 0.999));
            ds_oai_errorf(&oe, 503, NULL, "queue_full",
                          "the server is overloaded (request queue full); retry later");
            return send_error_h(c, &oe, MHD_HTTP_HEADER_RETRY_AFTER, ra);
        }
        if (why == DS_SUBMIT_INVALID)
            return send_errorf(c, 400, kind == DS_OAI_CHAT ? "messages" : "prompt", "invalid_value",
                               "the request cannot run: %s", err.msg);
        return send_errorf(c, 503, NULL, "unavailable", "the engine refused the request: %s",
                           err.msg);
    }
    pthread_mutex_lock(&r->mu);
    r->id = id;
    pthread_mutex_unlock(&r->mu);

    if (!r->oai.stream) return finish_plain(c, r);

    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, STREAM_BLOCK,
                                                                  stream_reader, r, stream_free);
    if (!resp) {
        gen_abandon(r);
        return MHD_NO;
    }
    pthread_mutex_lock(&r->mu);
    r->refs++; /* the response's reader */
    pthread_mutex_unlock(&r->mu);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp); /* MHD keeps its own reference until the stream ends */
    return ret;
}

/* ---------------------------------------------------------------------------------------------
 * other endpoints */

static enum MHD_Result handle_models(ds_server *s, struct MHD_Connection *c) {
    ds_engine *e = ready_engine(s);
    if (!e) return not_ready(s, c);
    json_t *m =
        json_pack("{s:s, s:s, s:I, s:s, s:s, s:n, s:i}", "id", s->model_name, "object", "model",
                  "created", (json_int_t)time(NULL), "owned_by", "deltaserve", "root",
                  ds_engine_model_dir(e), "parent", "max_model_len", ds_engine_max_model_len(e));
    json_object_set_new(m, "capabilities", ds_oai_capabilities(e));
    return send_json(c, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
}

static enum MHD_Result handle_metrics(ds_server *s, struct MHD_Connection *c) {
    ds_engine_stats st;
    memset(&st, 0, sizeof st);
    ds_engine *e = atomic_load(&s->engine);
    if (e) ds_engine_get_stats(e, &st);
    size_t len;
    ds_err err = {{0}};
    char *text = ds_metrics_render(s->metrics, &st, s->model_name, &len, &err);
    if (!text) return send_errorf(c, 500, NULL, NULL, "%s", err.msg);
    return send_buf(c, 200, text, len, "text/plain; version=0.0.4; charset=utf-8");
}

/* /tokenize: {"prompt": text} or {"messages": [...]} -> {tokens, count, max_model_len}. */
static enum MHD_Result handle_tokenize(ds_server *s, struct MHD_Connection *c, conn_ctx *cc) {
    ds_engine *e = ready_engine(s);
    if (!e) return not_ready(s, c);
    ds_oai_request q;
    ds_oai_error oe;
    int add_special = 0;
    if (ds_oai_parse_tokenize(cc->body, cc->len, s->model_name,
                              ds_tok_vocab_size(ds_engine_tokenizer(e)), &q, &add_special, &oe))
        return send_error(c, &oe);
    int has_prompt = q.kind == DS_OAI_COMPLETIONS;
    int32_t *ids = NULL;
    int n = 0;
    if (build_prompt(e, &q, &ids, &n, &oe)) {
        ds_oai_request_free(&q);
        return send_error(c, &oe);
    }
    ds_oai_request_free(&q);
    const ds_tokenizer *tok = ds_engine_tokenizer(e);
    json_t *arr = json_array();
    if (add_special && has_prompt && ds_tok_bos_id(tok) >= 0)
        json_array_append_new(arr, json_integer(ds_tok_bos_id(tok)));
    for (int i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    free(ids);
    return send_json(c, 200,
                     json_pack("{s:o, s:I, s:i}", "tokens", arr, "count",
                               (json_int_t)json_array_size(arr), "max_model_len",
                               ds_engine_max_model_len(e)));
}

/* /detokenize: {"tokens": [ids]} -> {"prompt": text}. */
static enum MHD_Result handle_detokenize(ds_server *s, struct MHD_Connection *c, conn_ctx *cc) {
    ds_engine *e = ready_engine(s);
    if (!e) return not_ready(s, c);
    const ds_tokenizer *tok = ds_engine_tokenizer(e);
    ds_oai_error oe;
    int32_t *ids = NULL;
    int n_ids = 0;
    if (ds_oai_parse_detokenize(cc->body, cc->len, s->model_name, ds_tok_vocab_size(tok), &ids,
                                &n_ids, &oe))
        return send_error(c, &oe);
    size_t n = (size_t)n_ids;
    char *text = NULL;
    size_t len = 0;
    ds_err err = {{0}};
    int rc = ds_tok_decode(tok, ids, (int)n, 0, &text, &len, &err);
    free(ids);
    if (rc) return send_errorf(c, 400, "tokens", "invalid_value", "tokens: %s", err.msg);
    json_t *p = ds_oai_json_string_lossy(text, len);
    free(text);
    return send_json(c, 200, json_pack("{s:o}", "prompt", p));
}

/* ---------------------------------------------------------------------------------------------
 * routing */

typedef enum {
    EP_COMPLETIONS,
    EP_CHAT,
    EP_MODELS,
    EP_HEALTH,
    EP_METRICS,
    EP_TOKENIZE,
    EP_DETOK
} ep;

/* ---------------------------------------------------------------------------------------------
 * limits: connections and buffered body bytes */

/* Grows cc's share of the buffered-body budget to `want` bytes; 0 (nothing taken) when the
 * budget has no room. */
static int reserve_body(ds_server *s, conn_ctx *cc, size_t want) {
    if (want <= cc->reserved) return 1;
    size_t more = want - cc->reserved;
    if (atomic_fetch_add(&s->inflight, more) + more > s->max_inflight) {
        atomic_fetch_sub(&s->inflight, more);
        return 0;
    }
    cc->reserved = want;
    return 1;
}

/* 503 with Retry-After and the connection closed: the server is out of `what`. */
static enum MHD_Result send_busy(ds_server *s, struct MHD_Connection *c, const char *what) {
    char ra[32];
    snprintf(ra, sizeof ra, "%d", (int)(s->retry_after + 0.999));
    ds_oai_error e;
    ds_oai_errorf(&e, 503, NULL, "server_busy", "the server is at its limit of %s; retry later",
                  what);
    return send_error_h(c, &e, MHD_HTTP_HEADER_RETRY_AFTER, ra);
}

static const struct route {
    const char *path;
    const char *method; /* the only one allowed (HEAD also for GET) */
    ep which;
} ROUTES[] = {
    {"/v1/completions", "POST", EP_COMPLETIONS},
    {"/v1/chat/completions", "POST", EP_CHAT},
    {"/v1/models", "GET", EP_MODELS},
    {"/health", "GET", EP_HEALTH},
    {"/metrics", "GET", EP_METRICS},
    {"/tokenize", "POST", EP_TOKENIZE},
    {"/detokenize", "POST", EP_DETOK},
};

static enum MHD_Result dispatch(ds_server *s, struct MHD_Connection *c, conn_ctx *cc,
                                const char *url, const char *method) {
    /* the API key was checked on the headers (on_request) */
    const struct route *r = NULL;
    for (size_t i = 0; i < DS_ARRAY_LEN(ROUTES); i++)
        if (strcmp(url, ROUTES[i].path) == 0) r = &ROUTES[i];
    if (!r) return send_errorf(c, 404, NULL, "not_found", "no such endpoint: %.200s", url);
    int get = strcmp(r->method, "GET") == 0;
    if (strcmp(method, r->method) && !(get && strcmp(method, "HEAD") == 0)) {
        ds_oai_error e;
        ds_oai_errorf(&e, 405, NULL, "method_not_allowed",
                      "%.16s %.200s: method not allowed (use %s)", method, url, r->method);
        return send_error_h(c, &e, MHD_HTTP_HEADER_ALLOW, get ? "GET, HEAD" : r->method);
    }
    if (cc->no_room) return send_busy(s, c, "request bodies being read");
    if (cc->seen > s->max_body)
        return send_errorf(c, 413, NULL, "request_too_large",
                           "the request body is %zu bytes; the limit is %zu", cc->seen,
                           s->max_body);
    switch (r->which) {
    case EP_COMPLETIONS:
        return handle_generate(s, c, cc, DS_OAI_COMPLETIONS);
    case EP_CHAT:
        return handle_generate(s, c, cc, DS_OAI_CHAT);
    case EP_MODELS:
        return handle_models(s, c);
    case EP_HEALTH:
        if (!ready_engine(s)) return not_ready(s, c);
        return send_buf(c, 200, NULL, 0, NULL);
    case EP_METRICS:
        return handle_metrics(s, c);
    case EP_TOKENIZE:
        return handle_tokenize(s, c, cc);
    case EP_DETOK:
        return handle_detokenize(s, c, cc);
    }
    return MHD_NO;
}

/* MHD's access handler: called once with the headers, then with body pieces, then once more with
 * *upload_size == 0 when the body is complete. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls) {
    ds_server *s = cls;
    conn_ctx *cc = *con_cls;
    if (!cc) {
        cc = calloc(1, sizeof *cc);
        if (!cc) return MHD_NO;
        *con_cls = cc;
        const char *cl =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        unsigned long long n = cc->declared = cl ? strtoull(cl, NULL, 10) : 0;
        const char *conn_h =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONNECTION);
        /* the next head is looked at before MHD reads it only when the connection is kept
         * alive (the gate knows whether this request's length on the wire is known) */
        if (strcmp(version, MHD_HTTP_VERSION_1_1) || (conn_h && strcasestr(conn_h, "close")))
            ds_gate_untracked(c);
        ds_oai_error fe;
        if (ds_http_check_framing(c, &fe)) /* answered at once, and the connection closed */
            return send_error_h(c, &fe, MHD_HTTP_HEADER_CONNECTION, "close");
        /* the key before the body: a client without it gets 401 before we read (or buffer) its
         * body; MHD closes the connection when a body is left unread */
        if (s->api_key && strncmp(url, "/v1/", 4) == 0 && !ds_http_authorized(c, s->api_key))
            return send_errorf(c, 401, NULL, "invalid_api_key",
                               "Incorrect or missing API key: send it as 'Authorization: Bearer "
                               "KEY'");
        if (ds_gate_open(s->gate) > s->max_conns) return send_busy(s, c, "connections");
        if (n > HARD_BODY_FACTOR * (unsigned long long)s->max_body)
            /* refuse at once rather than read a huge body; MHD then closes the connection */
            return send_errorf(c, 413, NULL, "request_too_large",
                               "the request body is %s bytes; the limit is %zu", cl, s->max_body);
        /* the body's room is taken before any byte is read: a full server says so at once */
        if (n && !reserve_body(s, cc, DS_MIN((size_t)n, s->max_body)))
            return send_busy(s, c, "request bodies being read");
        ds_gate_phase(c, DS_CONN_BODY); /* its deadline runs from here */
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        cc->seen += n;
        *upload_size = 0;
        if (cc->seen > HARD_BODY_FACTOR * s->max_body) return MHD_NO; /* chunked and huge: drop */
        if (cc->seen > s->max_body || cc->no_room) return MHD_YES;    /* discard; answered later */
        if (cc->len + n > cc->reserved && !reserve_body(s, cc, cc->len + n)) {
            cc->no_room = 1;
            return MHD_YES;
        }
        if (cc->len + n + 1 > cc->cap) {
            size_t cap = DS_MAX(2 * cc->cap, cc->len + n + 1);
            cap = DS_MIN(cap, s->max_body + 1);
            char *b = realloc(cc->body, cap);
            if (!b) return MHD_NO;
            cc->body = b, cc->cap = cap;
        }
        memcpy(cc->body + cc->len, upload_data, n);
        cc->len += n;
        cc->body[cc->len] = 0;
        return MHD_YES;
    }
    ds_gate_phase(c, DS_CONN_SERVING);
    cc->whole = 1;
    return dispatch(s, c, cc, url, method);
}

/* MHD's request-completed callback (connection thread), however the request ended. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    conn_ctx *cc = *con_cls;
    ds_server *s = cls;
    ds_gate_phase(c, DS_CONN_WAIT); /* kept alive: the next head's deadline runs from here */
    if (!cc) return;
    /* a body left unread (answered from the headers) closes the connection */
    int kept = toe == MHD_REQUEST_TERMINATED_COMPLETED_OK && cc->whole;
    unsigned long long body_bytes = cc->declared; /* chunked: 0, the gate counts it */
    if (cc->gen) {
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) gen_abandon(cc->gen);
        gen_unref(cc->gen);
        pthread_mutex_lock(&s->active_mu);
        s->n_active--;
        pthread_cond_broadcast(&s->active_cv);
        pthread_mutex_unlock(&s->active_mu);
    }
    atomic_fetch_sub(&s->inflight, cc->reserved);
    free(cc->body);
    free(cc);
    *con_cls = NULL;
    /* last: this may wait for the connection's next head (the thread would wait anyway) */
    ds_gate_request_done(c, kept, body_bytes);
}

/* ---------------------------------------------------------------------------------------------
 * life cycle */

void ds_server_opts_default(ds_server_opts *o) {
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->max_body_bytes = 16u << 20;
    o->retry_after_s = 1;
    o->max_connections = 2048;
    o->max_connections_per_ip = 256;
    o->idle_timeout_s = 60;
    o->max_inflight_body_bytes = 64u << 20;
    o->header_timeout_s = 10;
    o->body_timeout_s = 60;
}

int ds_server_create(const ds_server_opts *o, ds_server **out, ds_err *err) {
    *out = NULL;
    ds_server *s = ds_calloc(1, sizeof *s, err);
    if (!s) return DS_ERR;
    pthread_mutex_init(&s->active_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->active_cv, &ca);
    pthread_condattr_destroy(&ca);
    s->max_body = o->max_body_bytes ? o->max_body_bytes : 16u << 20;
    s->retry_after = o->retry_after_s > 0 ? o->retry_after_s : 1;
    s->max_conns = o->max_connections > 0 ? o->max_connections : 2048;
    double idle = o->idle_timeout_s > 0 ? o->idle_timeout_s : 60;
    s->keepalive_s = DS_MIN(idle / 3, 15.0);
    s->max_inflight = o->max_inflight_body_bytes ? o->max_inflight_body_bytes : 64u << 20;
    s->max_inflight = DS_MAX(s->max_inflight, s->max_body); /* one maximal body always fits */
    ds_http_raise_fd_limit(s->max_conns + CONN_RESERVE + 256);
    s->api_key = o->api_key && o->api_key[0] ? strdup(o->api_key) : NULL;
    s->model_name = strdup(o->served_model_name ? o->served_model_name : "model");
    s->id_salt = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() << 20;
    if (!s->model_name || (o->api_key && o->api_key[0] && !s->api_key) ||
        !(s->metrics = ds_metrics_new(err))) {
        ds_server_free(s);
        return ds_errf(err, "server: out of memory");
    }

    /* the gate listens and accepts; MHD gets each connection once its first head is whole and
     * well-formed (gate.h says why) */
    ds_gate_opts go = {.host = o->host && o->host[0] ? o->host : "127.0.0.1",
                       .port = o->port,
                       .max_connections = s->max_conns + CONN_RESERVE,
                       .max_per_ip = DS_MAX(o->max_connections_per_ip, 0),
                       .header_timeout_s = o->header_timeout_s > 0 ? o->header_timeout_s : 10,
                       .body_timeout_s = o->body_timeout_s > 0 ? o->body_timeout_s : 60,
                       .idle_timeout_s = idle};
    if (ds_gate_create(&go, &s->gate, err)) {
        ds_server_free(s);
        return DS_ERR;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_ERROR_LOG | MHD_USE_ITC | MHD_USE_NO_LISTEN_SOCKET;
    if (MHD_is_feature_supported(MHD_FEATURE_POLL)) flags |= MHD_USE_POLL;
    s->mhd = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
        MHD_OPTION_NOTIFY_CONNECTION, ds_gate_notify, s->gate, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)(idle + 0.999), MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)(s->max_conns + CONN_RESERVE),
        /* room for the largest head the gate lets through, its fields and a response head */
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)MHD_MEMORY, MHD_OPTION_END);
    if (!s->mhd) ds_errf(err, "server: libmicrohttpd failed to start");
    if (!s->mhd || ds_gate_start(s->gate, s->mhd, err)) {
        ds_server_free(s);
        return DS_ERR;
    }
    *out = s;
    return DS_OK;
}

int ds_server_port(const ds_server *s) {
    return ds_gate_port(s->gate);
}

void ds_server_attach(ds_server *s, ds_engine *e) {
    atomic_store(&s->engine, e);
}

void ds_server_quiesce(ds_server *s) {
    if (atomic_exchange(&s->quiesced, 1) || !s->gate) return;
    ds_gate_quiesce(s->gate);
}

int ds_server_drain(ds_server *s, double timeout_s) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double end = ts.tv_sec + ts.tv_nsec * 1e-9 + timeout_s;
    ts.tv_sec = (time_t)end;
    ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
    pthread_mutex_lock(&s->active_mu);
    while (s->n_active > 0)
        if (pthread_cond_timedwait(&s->active_cv, &s->active_mu, &ts) == ETIMEDOUT) break;
    int left = s->n_active;
    pthread_mutex_unlock(&s->active_mu);
    return left;
}

void ds_server_free(ds_server *s) {
    if (!s) return;
    ds_gate_stop(s->gate); /* no more connections handed to MHD */
    if (s->mhd) MHD_stop_daemon(s->mhd);
    ds_gate_destroy(s->gate); /* after MHD: its closing connections still report to the table */
    ds_metrics_free(s->metrics);
    pthread_cond_destroy(&s->active_cv);
    pthread_mutex_destroy(&s->active_mu);
    free(s->api_key);
    free(s->model_name);
    free(s);
}
