"""Fixtures for the end-to-end tests: real `deltaserve serve` processes on free ports.

DS_BIN   the executable (default: <repo>/build/deltaserve)
DS_MODEL the model folder (default: <repo>/models/tiny-k3, written by `make`)

Each server runs with small pools, listens on port 0 (the kernel picks a free port, which the
server prints), and is stopped with SIGTERM at the end; a server that does not exit 0 within the
grace period fails the session, so an unclean shutdown is caught too.
"""

import http.client
import json
import os
import shlex
import re
import signal
import subprocess
import threading
import time

import pytest

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "once: the test starts its own servers or none, whatever DS_SERVE_ARGS says, "
        "so it runs in the plain pass of `make test` only, not again in each configuration pass")


def pytest_collection_modifyitems(config, items):
    """In a configuration pass (DS_SERVE_ARGS set) the `once` tests would repeat the plain pass
    exactly: they are deselected there (and reported as deselected, not passed)."""
    if not os.environ.get("DS_SERVE_ARGS"):
        return
    keep = [i for i in items if not i.get_closest_marker("once")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("once")])
        items[:] = keep


REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DS_BIN = os.environ.get("DS_BIN", os.path.join(REPO, "build", "deltaserve"))
DS_MODEL = os.environ.get("DS_MODEL", os.path.join(REPO, "models", "tiny-k3"))
MODEL_NAME = os.path.basename(os.path.normpath(DS_MODEL))


class Server:
    """A running `deltaserve serve` and small helpers to talk to it."""

    def __init__(self, *extra_args, startup_timeout=120.0, env_args=True, model=None):
        if not os.path.exists(DS_BIN):
            pytest.fail(f"{DS_BIN} is not built (set DS_BIN)")
        if not os.path.exists(os.path.join(model or DS_MODEL, "config.json")):
            pytest.fail(f"no model at {DS_MODEL} (run make, or set DS_MODEL)")
        # DS_SERVE_ARGS runs the whole suite against another configuration (e.g. speculation).
        self.args = [DS_BIN, "serve", "--model", model or DS_MODEL, "--port", "0",
                     "--kv-cache-memory", "32M", "--shutdown-timeout", "2", *extra_args,
                     *(shlex.split(os.environ.get("DS_SERVE_ARGS", "")) if env_args else [])]
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.log = []
        self.port = None
        port_seen = threading.Event()

        def pump():  # keeps the pipe drained and finds the port line
            for line in self.proc.stdout:
                self.log.append(line)
                m = re.search(r"listening on \S+:(\d+)", line)
                if m and not port_seen.is_set():
                    self.port = int(m.group(1))
                    port_seen.set()
            port_seen.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        if not port_seen.wait(startup_timeout) or self.port is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        deadline = time.time() + startup_timeout
        while True:
            status, _, _ = self.request("GET", "/health")
            if status == 200:
                break
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("server never became healthy:\n" + "".join(self.log))
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def request(self, method, path, body=None, headers=None, timeout=60):
        """(status, headers dict (lower-case names), body bytes); body may be dict, str or bytes."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            if isinstance(body, str):
                body = body.encode()
            h = {"Content-Type": "application/json"} if body is not None else {}
            h.update(headers or {})
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        except (ConnectionError, OSError):
            return None, {}, b""
        finally:
            conn.close()

    def post_json(self, path, body, headers=None):
        status, h, data = self.request("POST", path, body, headers)
        return status, json.loads(data) if data else None

    def metrics(self):
        """{series (name + labels, without the prefix's model label): value} from /metrics."""
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")
            out[key] = float(value)
        return out

    def client(self, api_key="unused", **kw):
        import openai
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)

    def stop(self):
        """SIGTERM, then wait; returns the exit status (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        self.pump.join(timeout=5)
        return self.proc.returncode


def _server_fixture(*args):
    srv = Server(*args)
    yield srv
    alive = srv.proc.poll() is None
    rc = srv.stop()
    assert alive, "the server died during the tests:\n" + "".join(srv.log[-40:])
    assert rc == 0, f"server exited with {rc} on SIGTERM:\n" + "".join(srv.log[-40:])


@pytest.fixture(scope="session")
def server():
    """The shared server: small pools (32 sequences, so 64 clients queue) and a short context
    (1024, so a prompt at the limit is cheap to run)."""
    yield from _server_fixture("--max-num-seqs", "32", "--max-model-len", "1024", "--seed", "1")


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def greedy(server):
    """greedy(prompt, max_tokens) -> the text of a lone greedy completion, cached."""
    cache = {}

    def run(prompt, max_tokens=24):
        key = (json.dumps(prompt), max_tokens)
        if key not in cache:
            status, r = server.post_json("/v1/completions", {
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "logprobs": 0})
            assert status == 200, r
            c = r["choices"][0]
            cache[key] = (c["text"], c["logprobs"]["tokens"])
        return cache[key]
    return run


def sse_events(resp):
    """Yields the JSON payloads of an SSE response (http.client), then the string '[DONE]'."""
    buf = b""
    while True:
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
        if not chunk:
            return
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    payload = line[6:].decode()
                    yield payload if payload == "[DONE]" else json.loads(payload)
