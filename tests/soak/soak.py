#!/usr/bin/env python3
"""Soak test: one real `deltaserve serve` under a bounded storm of mixed traffic.

    DS_BIN=build/deltaserve DS_MODEL=models/tiny-k3 python3 tests/soak/soak.py --seconds 60

Many concurrent clients, for --seconds, each picking at random:
  valid completions and chat completions through the `openai` package (random sampling
  parameters, n > 1, stop strings, logprobs, token-id prompts, streaming with usage), streams
  dropped at a random point through a raw socket, malformed JSON, wrong types, random extra or
  out-of-range parameters, oversized bodies, broken HTTP, /tokenize, /detokenize, /v1/models,
  /metrics and /health.

It fails (exit 1, with the reasons and the server log's tail) when:
  - a valid request got neither a complete answer (every choice finished, usage adds up) nor a
    clean OpenAI-shaped error ({"error": {"message", "type", "param", "code"}});
  - an invalid request got anything but a 4xx with that error shape (a 5xx, a dropped
    connection, a success);
  - the server died, or did not exit 0 on SIGTERM at the end (with an ASan build in DS_BIN, that
    exit also reports leaks);
  - its resident memory grew by more than --rss-slack-mb from one third of the run to the end;
  - after the load, /metrics does not settle at 0 running, 0 waiting and 0 KV-cache usage, or
    /health does not answer 200.
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DS_BIN = os.environ.get("DS_BIN", os.path.join(REPO, "build", "deltaserve"))
DS_MODEL = os.environ.get("DS_MODEL", os.path.join(REPO, "models", "tiny-k3"))
MODEL = os.path.basename(os.path.normpath(DS_MODEL))

WORDS = ("the quick brown fox jumps over lazy dog 你好 世界 hello world code def return "
         "data model token cache page stream 12345 ! ? , . \n").split(" ")
OK_FINISH = ("stop", "length", "tool_calls")


class Failures:
    """Thread-safe list of what went wrong, and counters of what happened."""

    def __init__(self):
        self.mu = threading.Lock()
        self.items = []
        self.counts = {}
        self.slowest = (0.0, "")
        self.examples = {}

    def fail(self, what):
        with self.mu:
            if len(self.items) < 200:
                self.items.append(what)

    def example(self, key, text):
        with self.mu:
            self.examples.setdefault(key, text)

    def count(self, key):
        with self.mu:
            self.counts[key] = self.counts.get(key, 0) + 1


# ---- the server -------------------------------------------------------------------------------

class Server:
    def __init__(self, args, log_path):
        cmd = [DS_BIN, "serve", "--model", DS_MODEL, "--port", "0",
               "--kv-cache-memory", args.kv_cache, "--max-num-seqs", str(args.max_num_seqs),
               "--max-queue", str(args.max_queue), "--max-model-len", str(args.max_model_len),
               "--shutdown-timeout", "2"]
        # Small pools, so that the warm-up touches all of them and RSS can be flat afterwards.
        helptext = subprocess.run([DS_BIN, "serve", "--help"], capture_output=True,
                                  text=True).stdout
        if "--state-checkpoint-memory" in helptext:
            cmd += ["--state-checkpoint-memory", args.ckpt_memory]
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ)
        # one kernel thread: on a small machine shared with the clients, OpenMP threads spinning
        # at barriers while descheduled make every step ~50x slower
        env.setdefault("OMP_NUM_THREADS", "1")
        # A fixed mmap threshold: glibc otherwise raises it after freeing a big block (a 16 MiB
        # request body) and keeps later blocks of that size in the heap, so RSS would ratchet up
        # in steps that are not leaks. With it, RSS growth means memory still held.
        env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=262144")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, env=env)
        self.port = None
        seen = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                m = re.search(r"listening on \S+:(\d+)", line)
                if m and not seen.is_set():
                    self.port = int(m.group(1))
                    seen.set()
            seen.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        if not seen.wait(300) or self.port is None:
            raise RuntimeError("server did not start; see " + log_path)
        deadline = time.time() + 300
        while http_get(self.port, "/health")[0] != 200:
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("server never became healthy; see " + log_path)
            time.sleep(0.1)

    def rss_mb(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024.0
        except OSError:
            pass
        return None

    def stop(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        self.pump.join(timeout=5)
        self.log.close()
        return self.proc.returncode

    def tail(self, n=40):
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def http_req(port, method, path, body=None, headers=None, timeout=120):
    """(status or None, body bytes). None: the connection failed or was dropped."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode("utf-8", "surrogatepass")
        h = {"Content-Type": "application/json"} if body is not None else {}
        h.update(headers or {})
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException):
        return None, b""
    finally:
        conn.close()


def http_get(port, path):
    return http_req(port, "GET", path, timeout=30)


def metrics(port):
    status, data = http_get(port, "/metrics")
    if status != 200:
        return None
    out = {}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")
            out[key] = float(value)
    return out


def error_shape_ok(data):
    """The OpenAI error object: {"error": {"message": str, "type": str, "param", "code"}}."""
    try:
        j = json.loads(data)
        e = j["error"]
        return (isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str)
                and "param" in e and "code" in e)
    except (ValueError, KeyError, TypeError):
        return False


# ---- request makers ---------------------------------------------------------------------------

def rand_text(rng, lo=1, hi=40):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


# A few long shared prefixes (past the 256-token checkpoint rung), so that prefix caching hits.
PREFIXES = [rand_text(random.Random(i), 300, 300) for i in range(3)]


def prompt_text(rng):
    if rng.random() < 0.2:
        return rng.choice(PREFIXES) + " " + rand_text(rng, 1, 20)
    return rand_text(rng, 1, 200 if rng.random() < 0.1 else 40)


def sampling(rng, chat):
    """Random but valid sampling fields: (openai kwargs, extra_body)."""
    kw, extra = {}, {}
    if rng.random() < 0.7:
        kw["temperature"] = rng.choice([0, 0.3, 0.7, 1.0, 1.5])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([1.0, 0.9, 0.5, 0.1])
    if rng.random() < 0.4:
        extra["top_k"] = rng.choice([0, 1, 5, 50, -1])
    if rng.random() < 0.2:
        extra["min_p"] = rng.choice([0.0, 0.05, 0.2])
    if rng.random() < 0.5:
        kw["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.choice([-1.0, 0.0, 0.5, 2.0])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = rng.choice([-1.0, 0.0, 0.5, 2.0])
    if rng.random() < 0.3:
        kw["stop"] = [rng.choice(WORDS) or "x" for _ in range(rng.randint(1, 3))]
    kw["max_tokens"] = rng.randint(1, 24)
    if rng.random() < 0.2:
        extra["min_tokens"] = rng.randint(0, min(4, kw["max_tokens"]))
    if rng.random() < 0.2:
        extra["ignore_eos"] = True
    kw["n"] = rng.choice([1, 1, 1, 2, 3])
    if rng.random() < 0.3:
        if chat:
            kw["logprobs"] = True
            kw["top_logprobs"] = rng.randint(0, 5)
        else:
            kw["logprobs"] = rng.randint(0, 5)
    return kw, extra


def chat_messages(rng):
    msgs = []
    r = rng.random()
    if r < 0.2:
        msgs.append({"role": "system", "content": rng.choice(PREFIXES)})
    elif r < 0.45:
        msgs.append({"role": "system", "content": rand_text(rng, 1, 10)})
    for i in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": rand_text(rng)})
        if rng.random() < 0.5:
            msgs.append({"role": "assistant", "content": rand_text(rng, 1, 10)})
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": rand_text(rng)})
    return msgs


def valid_body(rng, chat, stream=False):
    kw, extra = sampling(rng, chat)
    body = dict(kw, **extra, model=MODEL)
    if chat:
        body["messages"] = chat_messages(rng)
    elif rng.random() < 0.2:
        body["prompt"] = [rng.randint(0, 700) for _ in range(rng.randint(1, 30))]
    else:
        body["prompt"] = prompt_text(rng)
    if stream:
        body["stream"] = True
    return body


# ---- scenarios --------------------------------------------------------------------------------

def check_plain(f, what, body, r, chat):
    n = body.get("n", 1)
    if len(r.choices) != n:
        return f.fail(f"{what}: {len(r.choices)} choices for n={n}")
    for c in r.choices:
        if c.finish_reason not in OK_FINISH:
            return f.fail(f"{what}: finish_reason {c.finish_reason!r}")
        # a chat message's content is null when it is empty (all reasoning, or only tool calls),
        # as OpenAI's; a completion's text is always a string
        text = c.message.content if chat else c.text
        if not isinstance(text, str) and not (chat and text is None):
            return f.fail(f"{what}: choice text is {type(text).__name__}")
    u = r.usage
    if u is None or u.completion_tokens > n * body["max_tokens"] or u.prompt_tokens < 1 or \
            u.total_tokens != u.prompt_tokens + u.completion_tokens:
        return f.fail(f"{what}: bad usage {u}")


def api_error_ok(f, what, e):
    """A valid request may be refused, but only with a clean OpenAI error."""
    import openai
    if isinstance(e, openai.APIStatusError):
        if e.status_code in (400, 503) and error_shape_ok(e.response.content):
            f.count(f"refused {e.status_code}")
            f.example(f"refused {e.status_code}", f"{what}: {e.response.content[:200]!r}")
            return
        f.fail(f"{what}: HTTP {e.status_code} {e.response.content[:300]!r}")
    else:
        f.fail(f"{what}: {type(e).__name__}: {e}")


def sc_valid(ctx, rng):
    chat = rng.random() < 0.5
    stream = rng.random() < 0.4
    body = valid_body(rng, chat)
    what = ("chat" if chat else "completion") + (" stream" if stream else "")
    f = ctx.f
    client = ctx.client
    args = {k: v for k, v in body.items()
            if k not in ("top_k", "min_p", "min_tokens", "ignore_eos")}
    extra = {k: body[k] for k in ("top_k", "min_p", "min_tokens", "ignore_eos") if k in body}
    try:
        if not stream:
            if chat:
                r = client.chat.completions.create(**args, extra_body=extra)
            else:
                r = client.completions.create(**args, extra_body=extra)
            check_plain(f, what, body, r, chat)
        else:
            create = client.chat.completions.create if chat else client.completions.create
            finished, usage = {}, None
            for chunk in create(**args, extra_body=extra, stream=True,
                                stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    if c.finish_reason is not None:
                        if c.index in finished:
                            return f.fail(f"{what}: choice {c.index} finished twice")
                        finished[c.index] = c.finish_reason
            n = body.get("n", 1)
            if sorted(finished) != list(range(n)) or \
                    any(v not in OK_FINISH for v in finished.values()):
                return f.fail(f"{what}: finishes {finished} for n={n}")
            if usage is None or usage.completion_tokens > n * body["max_tokens"]:
                return f.fail(f"{what}: bad usage {usage}")
        f.count("valid ok")
    except Exception as e:  # noqa: BLE001 - every failure mode is a finding
        api_error_ok(f, what, e)


def raw_post(port, path, body, timeout=60):
    return http_req(port, "POST", path, body, timeout=timeout)


def expect_4xx(ctx, what, status, data, allowed=(400, 404, 405, 413, 422)):
    if status is None:
        ctx.f.fail(f"{what}: connection dropped")
    elif status not in allowed or not error_shape_ok(data):
        ctx.f.fail(f"{what}: HTTP {status} {data[:300]!r}")
    else:
        ctx.f.count(f"rejected {status}")


def sc_malformed_json(ctx, rng):
    chat = rng.random() < 0.5
    text = json.dumps(valid_body(rng, chat))
    kind = rng.randint(0, 5)
    if kind == 0:
        text = text[:rng.randint(0, len(text) - 1)]
    elif kind == 1:
        i = rng.randint(0, len(text) - 1)
        text = text[:i] + rng.choice("{}[],:\"\\x") + text[i + 1:]
    elif kind == 2:
        text = "".join(chr(rng.randint(0, 255)) for _ in range(rng.randint(0, 200)))
    elif kind == 3:
        text = rng.choice(["", "null", "[]", "42", "\"str\"", "true", "{", "{}}", "\x00{}"])
    elif kind == 4:
        text = "{" + "\"a\":[" * 5000 + "]" * 5000 + "}"  # deep nesting
    else:
        text = text[:-1] + ", \"prompt\": \"dup\"}"  # duplicate key; fine or 400
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, data = raw_post(ctx.port, path, text.encode("latin-1"))
    if status == 200 and kind == 5:
        ctx.f.count("dup key accepted")
        return
    if status == 200 and kind == 1:  # a one-character edit can leave valid JSON
        ctx.f.count("mutation still valid")
        return
    if status == 503 and error_shape_ok(data):
        ctx.f.count("refused 503")
        return
    expect_4xx(ctx, f"malformed json (kind {kind}) {text[:80]!r}", status, data)


WRONG = [("temperature", "hot"), ("temperature", -1), ("temperature", [1]), ("top_p", 2),
         ("top_p", "x"), ("top_k", 1.5), ("max_tokens", -5), ("max_tokens", "10"),
         ("max_tokens", 10**12), ("n", 0), ("n", 1000), ("n", True), ("stop", {"a": 1}),
         ("stop", [1, 2]), ("stop", ["x"] * 100), ("seed", "s"), ("seed", -1.5),
         ("logprobs", 100), ("logprobs", "yes"), ("stream", "yes"), ("model", 5),
         ("model", "no-such-model"), ("prompt", 5), ("prompt", [[-1]]), ("prompt", [10**9]),
         ("prompt", ""), ("prompt", None), ("messages", 5), ("messages", []),
         ("messages", [{"role": "wizard", "content": "x"}]), ("messages", [{"content": 1}]),
         ("messages", [5]), ("presence_penalty", 10), ("frequency_penalty", "a"),
         ("stop_token_ids", [-3]), ("stop_token_ids", "a"), ("min_tokens", -1),
         ("stream_options", 5), ("best_of", 3), ("echo", True), ("logit_bias", {"1": 5}),
         ("suffix", "x"), ("min_p", 3), ("top_logprobs", 50), ("max_completion_tokens", -1)]


def sc_wrong_types(ctx, rng):
    chat = rng.random() < 0.5
    body = valid_body(rng, chat)
    key, val = rng.choice(WRONG)
    if key in ("prompt",) and chat:
        key = "messages"
    body[key] = val
    if key == "messages":
        body.pop("prompt", None)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, data = raw_post(ctx.port, path, body)
    if status == 200:
        # Some of these are valid for one endpoint (e.g. logprobs=True for chat, min_p is
        # clamped...): a success must then be a complete answer.
        try:
            j = json.loads(data)
            if all(c.get("finish_reason") in OK_FINISH for c in j["choices"]):
                ctx.f.count("odd value accepted")
                return
        except (ValueError, KeyError, TypeError):
            pass
        if body.get("stream") is True:
            ctx.f.count("odd value accepted")
            return
        ctx.f.fail(f"wrong type {key}={val!r}: HTTP 200 {data[:200]!r}")
        return
    if status == 503 and error_shape_ok(data):
        ctx.f.count("refused 503")
        return
    expect_4xx(ctx, f"wrong type {key}={val!r}", status, data)


def sc_random_params(ctx, rng):
    """Random extra fields with random values of random types on a valid body."""
    chat = rng.random() < 0.5
    body = valid_body(rng, chat)
    keys = [k for k, _ in WRONG] + ["foo", "user", "tools", "tool_choice", "response_format",
                                    "reasoning_effort", "chat_template_kwargs",
                                    "add_generation_prompt", "skip_special_tokens"]
    vals = [None, True, False, 0, -1, 1, 2**31, 2**63, -2**63, 1e308, float("nan"), 0.5, "",
            "auto", "x" * 1000, [], [1], {}, {"type": "json_object"}, {"thinking": False},
            [{"type": "function", "function": {"name": "f", "parameters": {}}}]]
    for _ in range(rng.randint(1, 4)):
        body[rng.choice(keys)] = rng.choice(vals)
    try:
        text = json.dumps(body, allow_nan=True)
    except (ValueError, TypeError):
        return
    path = "/v1/chat/completions" if chat else "/v1/completions"
    stream = body.get("stream") is True
    status, data = raw_post(ctx.port, path, text, timeout=300)
    if status == 200:
        if stream:
            if b"data: [DONE]" not in data:
                ctx.f.fail(f"random params stream without [DONE]: {text[:200]}")
            else:
                ctx.f.count("random ok")
            return
        try:
            j = json.loads(data)
            if all(c.get("finish_reason") in OK_FINISH for c in j["choices"]):
                ctx.f.count("random ok")
                return
        except (ValueError, KeyError, TypeError):
            pass
        ctx.f.fail(f"random params: incomplete 200 {data[:200]!r} for {text[:200]}")
    elif status == 503 and error_shape_ok(data):
        ctx.f.count("refused 503")
    else:
        expect_4xx(ctx, f"random params {text[:200]}", status, data)


def sc_disconnect(ctx, rng):
    """A streaming (or plain) request abandoned at a random point."""
    chat = rng.random() < 0.5
    body = valid_body(rng, chat, stream=rng.random() < 0.8)
    body["max_tokens"] = rng.randint(8, 64)
    body["ignore_eos"] = True
    payload = json.dumps(body).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # Connection: close, so that reading past the end of a short answer ends at once
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", ctx.port), timeout=60)
    try:
        mode = rng.random()
        if mode < 0.1:  # hang up in the middle of the body
            s.sendall(head + payload[:rng.randint(0, len(payload) - 1)])
        else:
            s.sendall(head + payload)
            if mode > 0.25:  # read a little of the answer first
                want, got = rng.randint(1, 3000), 0
                while got < want:
                    chunk = s.recv(min(4096, want - got))
                    if not chunk:
                        break
                    got += len(chunk)
        if rng.random() < 0.5:  # RST instead of FIN
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        ctx.f.count("disconnect")
    except OSError:
        ctx.f.count("disconnect (server closed first)")
    finally:
        s.close()


def sc_oversized(ctx, rng):
    """A body over the server's 16 MiB limit: a 413 (or the server closing while we send)."""
    size = 17 * 1024 * 1024
    prefix = b'{"model": "%s", "prompt": "' % MODEL.encode()
    body = prefix + b"a" * (size - len(prefix) - 2) + b'"}'
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"])
    status, data = raw_post(ctx.port, path, body)
    if status is None:
        ctx.f.count("oversized: closed")
    else:
        expect_4xx(ctx, "oversized body", status, data, allowed=(413,))


def sc_bad_http(ctx, rng):
    """Broken HTTP: garbage request lines, lying Content-Length, unknown paths and methods."""
    kind = rng.randint(0, 4)
    if kind == 0:
        status, data = http_req(ctx.port, rng.choice(["PUT", "DELETE", "GET", "PATCH"]),
                                rng.choice(["/v1/completions", "/v1/chat/completions"]), b"{}")
        expect_4xx(ctx, "wrong method", status, data, allowed=(404, 405))
        return
    if kind == 1:
        status, data = http_req(ctx.port, "GET", rng.choice(["/", "/v2/x", "/v1/models/../x",
                                                             "/%00", "/" + "a" * 5000]))
        if status is None or status < 400 or status >= 500:
            ctx.f.fail(f"unknown path: HTTP {status}")
        else:
            ctx.f.count("bad path")
        return
    s = socket.create_connection(("127.0.0.1", ctx.port), timeout=30)
    try:
        if kind == 2:
            s.sendall(bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 500))) + b"\r\n\r\n")
        elif kind == 3:  # promises more body than it sends, then leaves
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
                      b"\r\n{\"prompt\": \"abc")
        else:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                      b"\r\nzz\r\nbad chunk\r\n0\r\n\r\n")
        s.settimeout(5)
        try:
            s.recv(4096)
        except OSError:
            pass
        ctx.f.count("bad http")
    except OSError:
        ctx.f.count("bad http (closed)")
    finally:
        s.close()


def sc_tokenize(ctx, rng):
    kind = rng.randint(0, 5)
    if kind == 0:
        body, ok = {"prompt": rand_text(rng)}, True
    elif kind == 1:
        body, ok = {"messages": chat_messages(rng), "add_generation_prompt": True}, True
    elif kind == 2:
        body, ok = {"tokens": [rng.randint(0, 1000) for _ in range(rng.randint(0, 50))]}, True
    elif kind == 3:
        body, ok = {"tokens": rng.choice([[-1], [10**10], ["a"], 5, None, [1.5]])}, False
    elif kind == 4:
        body, ok = rng.choice(["{", "[]", "", {"prompt": 5}, {"messages": "x"}, {}]), False
    else:
        body, ok = {"prompt": rand_text(rng), "add_special_tokens": "yes"}, False
    path = "/detokenize" if kind in (2, 3) else "/tokenize"
    if kind == 4:
        path = rng.choice(["/tokenize", "/detokenize"])
    status, data = raw_post(ctx.port, path, body)
    if ok:
        if status == 200:
            ctx.f.count("tokenize ok")
        elif status == 400 and kind == 2 and error_shape_ok(data):
            ctx.f.count("detokenize range")  # ids >= vocab are a 400
        else:
            ctx.f.fail(f"{path} {str(body)[:100]}: HTTP {status} {data[:200]!r}")
    else:
        expect_4xx(ctx, f"{path} {str(body)[:100]}", status, data)


def sc_get(ctx, rng):
    path = rng.choice(["/v1/models", "/metrics", "/health"])
    status, data = http_get(ctx.port, path)
    if status != 200:
        ctx.f.fail(f"GET {path}: HTTP {status}")
    else:
        ctx.f.count("get ok")


SCENARIOS = [(sc_valid, 40), (sc_malformed_json, 10), (sc_wrong_types, 10),
             (sc_random_params, 10), (sc_disconnect, 12), (sc_bad_http, 5), (sc_tokenize, 6),
             (sc_get, 4), (sc_oversized, 0.3)]


class Ctx:
    def __init__(self, port, f):
        import openai
        self.port = port
        self.f = f
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    max_retries=0, timeout=300)


def worker(ctx, seed, deadline):
    rng = random.Random(seed)
    fns = [fn for fn, _ in SCENARIOS]
    weights = [w for _, w in SCENARIOS]
    while time.time() < deadline:
        fn = rng.choices(fns, weights)[0]
        t = time.time()
        try:
            fn(ctx, rng)
        except Exception:  # noqa: BLE001 - a bug in a scenario is a finding too
            ctx.f.fail(f"{fn.__name__} raised:\n{traceback.format_exc()}")
        t = time.time() - t
        if t > 10:
            ctx.f.count(f"slow {fn.__name__}")
            ctx.f.slowest = max(ctx.f.slowest, (t, fn.__name__))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=int(os.environ.get("SOAK_SEED", "1")))
    ap.add_argument("--kv-cache", default="16M")
    ap.add_argument("--ckpt-memory", default="4M")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rss-slack-mb", type=float, default=16)
    ap.add_argument("--log", default=os.path.join(REPO, "build", "soak-server.log"))
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.log), exist_ok=True)

    f = Failures()
    srv = Server(args, args.log)
    print(f"soak: {DS_BIN} serving {MODEL} on port {srv.port}, {args.clients} clients for "
          f"{args.seconds:.0f}s (seed {args.seed}); server log {args.log}", flush=True)
    ctx = Ctx(srv.port, f)
    t0 = time.time()
    deadline = t0 + args.seconds
    threads = [threading.Thread(target=worker, args=(ctx, args.seed * 1000 + i, deadline),
                                daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(args.seconds / 3)
    rss_third = srv.rss_mb()
    rss_peak = rss_third or 0
    timeline, next_sample = [], t0 + args.seconds / 3
    while any(t.is_alive() for t in threads):
        if srv.proc.poll() is not None:
            f.fail(f"the server died with status {srv.proc.returncode}")
            break
        r = srv.rss_mb() or 0
        rss_peak = max(rss_peak, r)
        if time.time() >= next_sample:
            timeline.append(f"{time.time() - t0:.0f}s:{r:.0f}")
            next_sample += args.seconds / 12
        time.sleep(1)
    for t in threads:
        t.join(timeout=400)
        if t.is_alive():
            f.fail("a client is stuck (no answer within 400 s)")
    elapsed = time.time() - t0

    if srv.proc.poll() is None:
        # Settle: abandoned requests are noticed and aborted; the pools must drain to empty.
        settle = time.time() + 60
        m = None
        while time.time() < settle:
            m = metrics(srv.port)
            if m and m.get("deltaserve:num_requests_running") == 0 and \
                    m.get("deltaserve:num_requests_waiting") == 0 and \
                    m.get("deltaserve:kv_cache_usage_perc") == 0:
                break
            time.sleep(0.5)
        if not m:
            f.fail("/metrics does not answer after the load")
        else:
            for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                v = m.get("deltaserve:" + k)
                if v != 0:
                    f.fail(f"after the load, {k} = {v} (expected 0)")
        status, _ = http_get(srv.port, "/health")
        if status != 200:
            f.fail(f"/health answers {status} after the load")
        rss_end = srv.rss_mb()
        if rss_third is not None and rss_end is not None and \
                rss_end > rss_third + args.rss_slack_mb:
            f.fail(f"RSS grew from {rss_third:.1f} MiB (1/3 of the run) to {rss_end:.1f} MiB "
                   f"(slack {args.rss_slack_mb} MiB)")
    else:
        rss_end = None
    rc = srv.stop()
    if rc != 0:
        f.fail(f"the server exited with {rc} on SIGTERM (expected 0)")

    total = sum(f.counts.values())
    print(f"soak: {total} requests in {elapsed:.0f}s; RSS at 1/3 {rss_third} MiB, peak "
          f"{rss_peak:.1f}, end {rss_end} MiB")
    print("soak: RSS MiB over time: " + " ".join(timeline))
    print("soak: " + ", ".join(f"{k}: {v}" for k, v in sorted(f.counts.items())))
    for k, v in sorted(f.examples.items()):
        print(f"soak: e.g. {k}: {v}")
    if f.slowest[0]:
        print(f"soak: slowest request {f.slowest[0]:.1f}s ({f.slowest[1]})")
    if f.items:
        print(f"soak: FAILED ({len(f.items)} findings):")
        for it in f.items[:40]:
            print("  - " + it)
        print("---- server log (tail) ----\n" + srv.tail())
        return 1
    print("soak: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
