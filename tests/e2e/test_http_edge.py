"""HTTP edge cases on raw sockets: message framing by RFC 9112, NULs in identifiers, the API key
checked before the body, and the metric names vLLM's dashboards query (issue 35)."""

import json
import socket
import time

import pytest

from conftest import MODEL_NAME, _server_fixture

TOKENIZE = json.dumps({"prompt": "hi"}).encode()


def exchange(port, data, timeout=5.0):
    """Sends data, reads until the server closes or goes quiet for `timeout` s.
    (bytes received, closed: whether the server closed the connection)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (and closed) before the whole body went: read the answer
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                return out, False
            except ConnectionResetError:
                return out, True
            if not chunk:
                return out, True
            out += chunk
    finally:
        s.close()


def exchange_on(s, data, timeout=5.0):
    """exchange() on an open socket s (closed after)."""
    s.settimeout(timeout)
    out = b""
    try:
        s.sendall(data)
        while chunk := s.recv(65536):
            out += chunk
        return out, True
    except socket.timeout:
        return out, False
    except (ConnectionResetError, BrokenPipeError):
        return out, True
    finally:
        s.close()


def responses(raw):
    """[(status, headers dict (lower-case), body bytes)] of the HTTP/1.1 responses in raw
    (Content-Length framed, as the server sends every non-streamed response)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        h = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
        n = int(h.get("content-length", len(rest)))
        out.append((status, h, rest[:n]))
        raw = rest[n:]
    return out


def post_head(path, *headers):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def lone_error(raw, status):
    """The one response in raw must be `status` with an OpenAI error body; returns the error."""
    rs = responses(raw)
    assert len(rs) == 1, rs
    got, h, body = rs[0]
    assert got == status, (got, body)
    assert h["content-type"] == "application/json"
    return json.loads(body)["error"]


def test_content_length_twice_different_is_400_and_closed(server):
    # the first value frames a valid /tokenize; the rest would be read as a second request
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    data = (post_head("/tokenize", f"Content-Length: {len(TOKENIZE)}",
                      f"Content-Length: {len(TOKENIZE) + len(smuggled)}") + TOKENIZE + smuggled)
    raw, closed = exchange(server.port, data)
    e = lone_error(raw, 400)
    assert "Content-Length" in e["message"]
    assert e["type"] == "invalid_request_error"
    assert closed


def test_content_length_twice_same_is_one(server):
    data = post_head("/tokenize", f"Content-Length: {len(TOKENIZE)}",
                     f"Content-Length: {len(TOKENIZE)}", "Connection: close") + TOKENIZE
    raw, _ = exchange(server.port, data)
    rs = responses(raw)
    assert [r[0] for r in rs] == [200]
    assert json.loads(rs[0][2])["count"] >= 1


@pytest.mark.parametrize("te,status", [
    ("gzip", 501), ("identity", 501), ("gzip, chunked", 501), ("x-custom", 501),
    ("chunked, gzip", 400), ("chunked, chunked", 400), ("chunked,", 400)])
def test_transfer_encoding_other_than_chunked_answered_at_once(server, te, status):
    t0 = time.time()
    raw, closed = exchange(server.port, post_head("/tokenize", f"Transfer-Encoding: {te}")
                           + b"5\r\nhello\r\n0\r\n\r\n")
    assert time.time() - t0 < 4.5, "no answer: the server waited for more body"
    e = lone_error(raw, status)
    assert "Transfer-Encoding" in e["message"]
    assert closed


def test_transfer_encoding_with_content_length_is_400(server):
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(TOKENIZE), TOKENIZE)
    raw, closed = exchange(server.port, post_head(
        "/tokenize", "Transfer-Encoding: chunked", f"Content-Length: {len(chunked)}") + chunked)
    e = lone_error(raw, 400)
    assert "Content-Length" in e["message"]
    assert closed


def test_plain_chunked_still_works(server):
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(TOKENIZE), TOKENIZE)
    raw, _ = exchange(server.port, post_head(
        "/tokenize", "Transfer-Encoding: Chunked", "Connection: close") + chunked)
    assert [r[0] for r in responses(raw)] == [200]


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_chunked_sent_slowly_and_with_expect_100_still_works(server):
    # the head first, the body 0.3 s later in two writes (the gate waits for it); and a client
    # that waits for "100 Continue" before its body (the gate must not wait for it)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(TOKENIZE), TOKENIZE)
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    s.sendall(post_head("/tokenize", "Transfer-Encoding: chunked", "Connection: close"))
    time.sleep(0.3)
    s.sendall(chunked[:5])
    time.sleep(0.3)
    raw, _ = exchange_on(s, chunked[5:])
    assert [r[0] for r in responses(raw)] == [200]
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    s.sendall(post_head("/tokenize", "Transfer-Encoding: chunked", "Expect: 100-continue",
                        "Connection: close"))
    assert s.recv(65536).startswith(b"HTTP/1.1 100")
    raw, _ = exchange_on(s, chunked)
    assert [r[0] for r in responses(raw)] == [200]


@pytest.mark.parametrize("body,says", [
    (b"zz\r\nabc\r\n0\r\n\r\n", "hexadecimal"),
    (b"3\r\nabcdef\r\n0\r\n\r\n", "longer than its size"),
    (b"3\r\nabc\r\n0\r\nNoColon\r\n\r\n", "trailer")])
@pytest.mark.parametrize("after_one", [False, True])
def test_bad_chunked_framing_in_json(server, body, says, after_one):
    # first on a connection, and on a kept-alive one after a request answered
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    if after_one:
        s.sendall(H + b"\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    got, closed = exchange_on(s, post_head("/tokenize", "Transfer-Encoding: chunked") + body)
    e = lone_error(got, 400)
    assert "chunked" in e["message"] and says in e["message"], e
    assert closed


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL_NAME + "\u0000junk", "prompt": "x", "max_tokens": 1},
     "model"),
    ("/v1/chat/completions", {"model": MODEL_NAME + "\u0000", "max_tokens": 1,
                              "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1, "tool_choice": "auto\u0000x",
                              "messages": [{"role": "user", "content": "x"}]}, "tool_choice"),
    ("/tokenize", {"model": MODEL_NAME + "\u0000", "prompt": "x"}, "model"),
    ("/detokenize", {"model": MODEL_NAME + "\u0000", "tokens": [1]}, "model"),
])
def test_nul_in_identifier_is_400(server, path, body, param):
    status, r = server.post_json(path, body)
    assert status == 400, r
    assert r["error"]["param"] == param
    assert "NUL" in r["error"]["message"]


@pytest.fixture(scope="module")
def keyed_server():
    yield from _server_fixture("--api-key", "sekrit-42")


def test_api_key_checked_before_the_body(keyed_server):
    # a 10 MB body is announced but never sent: the 401 must come from the headers alone
    for auth in [None, "Authorization: Bearer wrong"]:
        head = post_head("/v1/completions", "Content-Length: 10000000", *([auth] if auth else []))
        t0 = time.time()
        raw, closed = exchange(keyed_server.port, head)
        assert time.time() - t0 < 4.5, "no answer: the server waited for the body"
        assert lone_error(raw, 401)["code"] == "invalid_api_key"
        assert closed
    # the right key still reads the body
    body = json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}).encode()
    raw, _ = exchange(keyed_server.port, post_head(
        "/v1/completions", "Authorization: Bearer sekrit-42", f"Content-Length: {len(body)}",
        "Connection: close") + body)
    assert [r[0] for r in responses(raw)] == [200]


def test_vllm_metric_names(server):
    status, r = server.post_json("/v1/completions", {
        "model": MODEL_NAME, "prompt": "1 + 1 =", "max_tokens": 3, "ignore_eos": True})
    assert status == 200, r
    _, _, text = server.request("GET", "/metrics")
    text = text.decode()
    for name, kind in [("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                       ("kv_cache_usage_perc", "gauge"), ("gpu_cache_usage_perc", "gauge"),
                       ("prompt_tokens_total", "counter"), ("generation_tokens_total", "counter"),
                       ("request_success_total", "counter"),
                       ("time_to_first_token_seconds", "histogram"),
                       ("time_per_output_token_seconds", "histogram"),
                       ("inter_token_latency_seconds", "histogram"),
                       ("e2e_request_latency_seconds", "histogram")]:
        assert f"# TYPE vllm:{name} {kind}\n" in text, name
    m = server.metrics()
    assert m["vllm:prompt_tokens_total"] >= r["usage"]["prompt_tokens"]
    assert m["vllm:generation_tokens_total"] >= 3
    assert m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1
    assert m["vllm:e2e_request_latency_seconds_sum"] > 0
    assert m['vllm:time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        m["vllm:time_to_first_token_seconds_count"]
    assert m['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert 0 <= m["vllm:gpu_cache_usage_perc"] <= 1
    assert m["vllm:gpu_cache_usage_perc"] == m["vllm:kv_cache_usage_perc"]
    assert m["vllm:num_requests_running"] >= 0 and m["vllm:num_requests_waiting"] >= 0
    # the deltaserve: names stay as aliases of the same numbers
    for k in ["prompt_tokens_total", "e2e_request_latency_seconds_count"]:
        assert m["deltaserve:" + k] == m["vllm:" + k]


# ---------------------------------------------------------------------------------------------
# limits: connections per address and in all, buffered body bytes

def connect_from(src, port, timeout=5.0):
    """A socket to the server from the loopback address src (127.0.0.0/8 is all loopback)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


def get_from(src, port, path="/health", timeout=5.0):
    """(status, headers, body) of GET path sent from src, or (None, {}, b"") if refused."""
    try:
        s = connect_from(src, port, timeout)
    except OSError:
        return None, {}, b""
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    except OSError:
        pass
    finally:
        s.close()
    rs = responses(raw)
    return rs[0] if rs else (None, {}, b"")


def half_sent(src, port, n):
    """n connections from src, each stopped in the middle of its headers."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 256), hard))
    socks = []
    for _ in range(n):
        try:
            s = connect_from(src, port, timeout=2.0)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
            socks.append(s)
        except OSError:
            pass  # refused at the limit: what the test wants
    return socks


@pytest.fixture(scope="module")
def default_server():
    """A server with the default HTTP limits (the session server's are the same, but this test
    floods it)."""
    yield from _server_fixture()


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_idle_half_sent_connections_do_not_lock_out_others(default_server):
    port = default_server.port
    socks = half_sent("127.0.0.1", port, 2000)
    try:
        t0 = time.time()
        status, _, _ = get_from("127.0.0.2", port)
        assert status == 200, "another address was locked out by one address's idle connections"
        assert time.time() - t0 < 4
        body = json.dumps({"model": MODEL_NAME, "prompt": "1 +", "max_tokens": 2}).encode()
        s = connect_from("127.0.0.3", port)
        s.sendall(post_head("/v1/completions", f"Content-Length: {len(body)}",
                            "Connection: close") + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
        s.close()
        assert [r[0] for r in responses(raw)] == [200]
    finally:
        for s in socks:
            s.close()


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_connection_limit_answers_503_with_retry_after():
    srv_gen = _server_fixture("--max-connections", "8")
    srv = next(srv_gen)
    try:
        socks = half_sent("127.0.0.5", srv.port, 12)
        assert len(socks) == 12  # past the limit MHD still accepts (a reserve), to answer 503
        status, h, body = get_from("127.0.0.6", srv.port)
        assert status == 503, body
        assert int(h["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "server_busy"
        for s in socks:
            s.close()
        deadline = time.time() + 10
        while get_from("127.0.0.6", srv.port)[0] != 200:
            assert time.time() < deadline, "the limit was not freed when connections closed"
            time.sleep(0.1)
    finally:
        for _ in srv_gen:
            pass


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_every_way_a_connection_ends_frees_its_slot():
    """300 connections ended every way (answered and closed, refused by the gate, hung up
    mid-head or mid-body, kept alive then refused, pipelined) through a table of 8 + 64 slots:
    a slot kept by any of them would leave the server refusing connections."""
    srv_gen = _server_fixture("--max-connections", "8")
    srv = next(srv_gen)
    try:
        port = srv.port
        ends = [
            lambda: exchange(port, H + b"Connection: close\r\n\r\n", timeout=2),
            lambda: exchange(port, H + b"NoColon\r\n\r\n", timeout=2),
            lambda: exchange(port, H + b"\r\n" + H + b"NoColon\r\n\r\n", timeout=2),
            lambda: exchange(port, CHUNKED_TOKENIZE + b"GET / HTTP/9.9\r\n\r\n", timeout=2),
            lambda: exchange(port, post_head("/tokenize", "Content-Length: 100") + b"{", 0.2),
        ]
        for i in range(300):
            if i % 6 == 5:  # hung up mid-head
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"GET /hea")
                s.close()
                continue
            ends[i % 6]()
        deadline = time.time() + 10
        while get_from("127.0.0.9", port)[0] != 200:
            assert time.time() < deadline, "connection slots were not given back"
            time.sleep(0.1)
        # and all 8 + 64 are there: 12 half-sent connections still leave /health a 503, not a reset
        socks = half_sent("127.0.0.10", port, 12)
        assert len(socks) == 12
        assert get_from("127.0.0.11", port)[0] == 503
        for s in socks:
            s.close()
    finally:
        for _ in srv_gen:
            pass


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_inflight_body_bytes_bound():
    srv_gen = _server_fixture("--max-inflight-body-bytes", "16M")
    srv = next(srv_gen)
    try:
        # announces a 16 MiB body (the whole budget) and sends none of it
        hog = connect_from("127.0.0.7", srv.port)
        hog.sendall(post_head("/tokenize", f"Content-Length: {16 << 20}"))
        time.sleep(0.3)
        t0 = time.time()
        raw, closed = exchange(srv.port, post_head("/tokenize", f"Content-Length: {len(TOKENIZE)}")
                               + TOKENIZE)
        assert time.time() - t0 < 4
        e = lone_error(raw, 503)
        assert e["code"] == "server_busy" and "bodies" in e["message"]
        hog.close()
        deadline = time.time() + 10
        while True:
            raw, _ = exchange(srv.port, post_head(
                "/tokenize", f"Content-Length: {len(TOKENIZE)}", "Connection: close") + TOKENIZE)
            if responses(raw) and responses(raw)[0][0] == 200:
                break
            assert time.time() < deadline, "the body budget was not given back"
            time.sleep(0.1)
    finally:
        for _ in srv_gen:
            pass


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_parallel_maximal_bodies_bounded_memory():
    """64 clients each send a 15 MiB body at once: every one is answered (400: the prompt is too
    long; or 503 + Retry-After: the body budget is full), none reset, and the server's memory
    grows by a bounded amount (without the bound it grew by ~4.5 GB)."""
    import collections
    import threading
    srv_gen = _server_fixture()
    srv = next(srv_gen)

    def rss_mb():
        with open(f"/proc/{srv.proc.pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024

    try:
        base = rss_mb()
        body = json.dumps({"model": MODEL_NAME, "prompt": "a " * (15 << 19),
                           "max_tokens": 1}).encode()
        head = post_head("/v1/completions", f"Content-Length: {len(body)}", "Connection: close")
        codes = collections.Counter()

        def one():
            try:
                raw, _ = exchange(srv.port, head + body, timeout=120)
                rs = responses(raw)
                codes[rs[0][0] if rs else "nothing"] += 1
                if rs and rs[0][0] == 503:
                    assert int(rs[0][1]["retry-after"]) >= 1
            except OSError as e:
                codes[type(e).__name__] += 1

        threads = [threading.Thread(target=one) for _ in range(64)]
        peak = base
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss_mb())
            time.sleep(0.02)
        assert set(codes) <= {400, 503}, codes
        assert codes[503] >= 32, codes  # most wait their turn: 64 MiB holds 4 such bodies
        assert peak - base < 700, f"server memory grew {peak - base:.0f} MB ({codes})"
        # the budget is whole again afterwards
        raw, _ = exchange(srv.port, post_head("/tokenize", f"Content-Length: {len(TOKENIZE)}",
                                              "Connection: close") + TOKENIZE)
        assert responses(raw)[0][0] == 200
    finally:
        for _ in srv_gen:
            pass


def test_stream_waiting_longer_than_idle_timeout_is_kept_alive():
    """A stream queued behind a long request outlives a 1 s idle timeout: it writes SSE comments
    while it waits (which OpenAI's client ignores), and its tokens then arrive whole."""
    import threading
    srv_gen = _server_fixture("--max-num-seqs", "1", "--http-idle-timeout", "1")
    srv = next(srv_gen)
    try:
        # two long requests ahead of it, one running and one waiting (a tiny model decodes a
        # few thousand tokens a second: one alone often ended before the idle timeout)
        longs = [threading.Thread(target=srv.post_json, args=("/v1/completions", {
            "model": MODEL_NAME, "prompt": f"{i} +", "max_tokens": 4000, "ignore_eos": True}))
            for i in (1, 3)]
        longs[0].start()
        deadline = time.time() + 10
        while srv.metrics()["vllm:num_requests_running"] < 1:
            assert time.time() < deadline
            time.sleep(0.02)
        longs[1].start()
        while srv.metrics()["vllm:num_requests_waiting"] < 1:
            assert time.time() < deadline
            time.sleep(0.02)
        t0 = time.time()
        stream = srv.client().completions.create(model=MODEL_NAME, prompt="2 +", max_tokens=5,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        chunks = [c for c in stream]
        waited = time.time() - t0
        for t in longs:
            t.join()
        # every token arrived (a token's text may be empty: count them by the usage), and the
        # text is the same request's answer without streaming
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length"
        whole = srv.client().completions.create(model=MODEL_NAME, prompt="2 +", max_tokens=5,
                                                temperature=0, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert waited > 1.5, f"the long requests ended too soon ({waited:.1f} s) to test the timeout"
    finally:
        for _ in srv_gen:
            pass


# ---------------------------------------------------------------------------------------------
# malformed heads: the server's gate answers them in JSON, not libmicrohttpd's HTML pages

H = b"GET /health HTTP/1.1\r\nHost: x\r\n"


@pytest.mark.parametrize("raw,status,says", [
    (H + b"NoColonHere\r\n\r\n", 400, "Name: value"),                        # a malformed field
    (b"GET /health HTTP/2.7\r\nHost: x\r\n\r\n", 505, "HTTP/2.7"),          # an unknown version
    (H + b"X-A: " + b"a" * 100000 + b"\r\n\r\n", 431, "16384 bytes"),     # a head too large
    (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "URL"),  # a URL too long
    (H + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n", 431, "fields"),
    (b"GET /health HTTP/1.1\r\n\r\n", 400, "Host"),                          # no Host in 1.1
    (H + b"Host: y\r\n\r\n", 400, "Host"),                                  # two Hosts
    (H + b"X-A : b\r\n\r\n", 400, "before the colon"),                       # space before ':'
    (H + b"X-A: b\r\n  folded\r\n\r\n", 400, "folded"),                      # obs-fold
    (H + b"X-A: b\x00c\r\n\r\n", 400, "control byte"),                       # a NUL in a value
    (b"GET /health\r\n\r\n", 400, "request line"),                           # HTTP/0.9
    (b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "request line"),     # two spaces
])
def test_protocol_errors_in_json(server, raw, status, says):
    got, closed = exchange(server.port, raw)
    e = lone_error(got, status)
    assert e["type"] == "invalid_request_error"
    assert says in e["message"], e
    assert closed


def test_malformed_head_answered_before_it_ends(server):
    # a bad request line is refused at once, without waiting for the rest of the head
    t0 = time.time()
    got, closed = exchange(server.port, b"GET /health HTTP/9.9\r\nHost: x\r\n", timeout=8)
    assert lone_error(got, 505)["code"] == "http_version_not_supported"
    assert closed and time.time() - t0 < 4


def test_http10_without_host_and_pipelining_still_work(server):
    got, _ = exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n")
    assert [r[0] for r in responses(got)] == [200]
    # two requests in one write (pipelined) and a POST with its body: three answers, in order
    tok = post_head("/tokenize", f"Content-Length: {len(TOKENIZE)}") + TOKENIZE
    last = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    got, _ = exchange(server.port, H + b"\r\n" + tok + last)
    rs = responses(got)
    assert [r[0] for r in rs] == [200, 200, 200]
    assert json.loads(rs[1][2])["count"] >= 1 and json.loads(rs[2][2])["data"]


# ---------------------------------------------------------------------------------------------
# deadlines: a client trickling a byte at a time is cut off (slowloris)

@pytest.fixture(scope="module")
def short_deadlines():
    yield from _server_fixture("--http-header-timeout", "1", "--http-body-timeout", "1.5",
                               "--http-idle-timeout", "2")


def trickle(port, first, drip, every=0.3, limit=12.0, sock=None):
    """Sends `first`, then one byte of `drip` every `every` s (its idle timeout never fires) until
    the server answers or closes. (bytes received, seconds after the drip began)."""
    s = sock or socket.create_connection(("127.0.0.1", port), timeout=limit)
    s.sendall(first)
    t0, out, i = time.time(), b"", 0
    try:
        while time.time() - t0 < limit:
            s.settimeout(every)
            try:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                continue
            except socket.timeout:
                pass
            try:
                s.sendall(drip[i % len(drip):i % len(drip) + 1])
            except OSError:
                break
            i += 1
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return out, time.time() - t0


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_head_trickled_gets_408(short_deadlines):
    got, took = trickle(short_deadlines.port, b"G", b"ET /health HTTP/1.1\r\nX-" + b"a" * 200)
    e = lone_error(got, 408)
    assert e["code"] == "request_timeout" and "head" in e["message"]
    assert took < 3.5, took  # the head deadline (1 s), not the idle timeout (never hit)
    assert get_from("127.0.0.1", short_deadlines.port)[0] == 200  # the server is fine


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_body_trickled_gets_408(short_deadlines):
    head = post_head("/tokenize", "Content-Length: 1000")
    got, took = trickle(short_deadlines.port, head, b"x")
    assert took < 4.5, took  # the body deadline (1.5 s)
    if got:  # best effort: the 408 is written on libmicrohttpd's socket as it is cut off
        assert lone_error(got, 408)["code"] == "request_timeout"


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_chunked_body_trickled_gets_408(short_deadlines):
    head = post_head("/tokenize", "Transfer-Encoding: chunked")
    got, took = trickle(short_deadlines.port, head, b"1\r\nx\r\n")
    e = lone_error(got, 408)
    assert e["code"] == "request_timeout" and "body" in e["message"]
    assert took < 3.5, took  # the body deadline (1.5 s)


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_keepalive_next_head_trickled_is_cut_off(short_deadlines):
    port = short_deadlines.port
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(H + b"\r\n")
    first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    got, took = trickle(port, b"G", b"ET /health HTTP/1.1\r\nX-" + b"a" * 200, sock=s)
    assert took < 3, took  # the head deadline (1 s) from the next head's first byte
    e = lone_error(got, 408)
    assert e["code"] == "request_timeout" and "head" in e["message"]


CHUNKED_TOKENIZE = post_head("/tokenize", "Transfer-Encoding: chunked") + (
    b"%x\r\n%s\r\n0\r\n\r\n" % (len(TOKENIZE), TOKENIZE))


@pytest.mark.parametrize("first", [
    H + b"\r\n",
    post_head("/tokenize", f"Content-Length: {len(TOKENIZE)}") + TOKENIZE,
    CHUNKED_TOKENIZE])
@pytest.mark.parametrize("bad,status", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n", 400),
    (b"GET /health HTTP/3.0\r\nHost: x\r\n\r\n", 505),
    (H + b"X-A: " + b"a" * 30000 + b"\r\n\r\n", 431)])
def test_keepalive_next_head_malformed_in_json(server, first, bad, status):
    # after a request answered on a kept-alive connection, a malformed next head is answered in
    # JSON too (libmicrohttpd would read it and answer in HTML)
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    s.sendall(first)
    raw = b""
    while not responses(raw) or len(responses(raw)[0][2]) < int(
            responses(raw)[0][1].get("content-length", 0)):
        raw += s.recv(65536)
    assert responses(raw)[0][0] == 200
    got, closed = exchange_on(s, bad)
    e = lone_error(got, status)
    assert e["type"] == "invalid_request_error"
    assert closed


@pytest.mark.parametrize("first", [
    H + b"\r\n",
    post_head("/tokenize", f"Content-Length: {len(TOKENIZE)}") + TOKENIZE,
    CHUNKED_TOKENIZE])
def test_pipelined_malformed_head_in_json(server, first):
    # a good request and a malformed one in one write: the first is answered, then the second is
    # refused in JSON (it was seen when the first was peeked)
    got, closed = exchange(server.port, first + H + b"NoColonHere\r\n\r\n")
    rs = responses(got)
    assert [r[0] for r in rs] == [200, 400], got[-300:]
    assert rs[1][1]["content-type"] == "application/json"
    assert "Name: value" in json.loads(rs[1][2])["error"]["message"]
    assert closed


@pytest.mark.once  # the HTTP gate's deadlines and limits: the engine's configuration changes nothing
def test_slow_but_steady_keepalive_still_served(short_deadlines):
    # a kept-alive connection idle for less than its idle timeout, whose next head then comes
    # whole, is served as before
    port = short_deadlines.port
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    for _ in range(3):
        s.sendall(H + b"\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(1.2)
    s.close()
