"""Many clients at once: disconnects mid-stream, batch independence of greedy output, and the
engine's gauges back at zero afterwards."""

import http.client
import json
import random
import socket
import threading
import time

from conftest import MODEL_NAME, sse_events

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning",
           "Hello, my name is", "Tokyo is a city"]


def open_stream(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn


def wait_idle(server, timeout=20):
    """Polls /metrics until nothing runs or waits and every page and slot is free."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        busy = (m["deltaserve:num_requests_running"], m["deltaserve:num_requests_waiting"],
                m["deltaserve:kv_cache_usage_perc"], m["deltaserve:state_slot_usage_perc"])
        if busy == (0, 0, 0, 0) or time.time() > deadline:
            return busy, m
        time.sleep(0.05)


def test_64_streams_with_disconnects(server, greedy):
    max_tokens = 24
    want = {p: greedy(p, max_tokens)[0] for p in PROMPTS}
    rng = random.Random(1234)
    n_clients = 64
    leavers = set(rng.sample(range(n_clients), n_clients // 3))
    # where each leaver goes: -1 right after sending (still queued), else after k events
    leave_after = {i: rng.choice([-1, 0, 1, 2, 3, 5, 8]) for i in leavers}
    _, before = wait_idle(server)
    results, errors = {}, []
    start = threading.Barrier(n_clients)

    def client(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        # leavers ask for far more than they read, so their requests are still running when
        # they hang up and must be aborted by the server
        body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "ignore_eos": True,
                "max_tokens": 900 if i in leavers else max_tokens}
        try:
            start.wait()
            conn = open_stream(server.port, body)
            if i in leavers and leave_after[i] < 0:
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                return
            resp = conn.getresponse()
            assert resp.status == 200
            text, finish, k = "", None, 0
            for ev in sse_events(resp):
                if ev == "[DONE]":
                    break
                if i in leavers and k >= leave_after[i]:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    conn.close()
                    return
                k += 1
                text += ev["choices"][0]["text"]
                finish = ev["choices"][0]["finish_reason"] or finish
            results[i] = (prompt, text, finish)
            conn.close()
        except Exception as e:  # noqa: BLE001 - reported below with the client's number
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    stayers = [i for i in range(n_clients) if i not in leavers]
    assert sorted(results) == stayers
    for i in stayers:
        prompt, text, finish = results[i]
        assert text == want[prompt], f"client {i}: {text!r} != {want[prompt]!r}"
        assert finish == "length"

    busy, after = wait_idle(server)
    assert busy == (0, 0, 0, 0), f"running, waiting, kv, slots after the storm: {busy}"
    key = 'deltaserve:request_success_total{finished_reason="%s"}'
    assert after[key % "abort"] - before[key % "abort"] == len(leavers)
    assert after[key % "length"] - before[key % "length"] == len(stayers)
    assert server.request("GET", "/health")[0] == 200


def test_greedy_alone_equals_inside_busy_batch(server, client, greedy):
    """Invariant 7: the same greedy request gives the same tokens alone and in a busy batch."""
    target = "Invariant seven says"
    alone_text, alone_tokens = greedy(target, 32)
    noise = []
    for i in range(24):  # a crowd of different lengths, sampled and greedy, arriving first
        body = {"model": MODEL_NAME, "prompt": PROMPTS[i % 5] * (1 + i % 4),
                "max_tokens": 40 + i, "ignore_eos": True,
                "temperature": 0 if i % 2 else 0.8, "seed": i}
        noise.append(open_stream(server.port, body))
    responses = [c.getresponse() for c in noise]  # all admitted and streaming
    r = client.completions.create(model=MODEL_NAME, prompt=target, max_tokens=32, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == alone_tokens
    assert r.choices[0].text == alone_text
    for resp, c in zip(responses, noise):
        events = list(sse_events(resp))
        assert events[-1] == "[DONE]"
        c.close()
    busy, _ = wait_idle(server)
    assert busy == (0, 0, 0, 0)


def test_non_stream_client_disconnect_aborts(server):
    """A plain (non-streaming) request whose client hangs up is aborted, not run to the end."""
    _, before = wait_idle(server)
    s = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    deadline = time.time() + 20
    while server.metrics()["deltaserve:num_requests_running"] < 1 and time.time() < deadline:
        time.sleep(0.01)  # hang up only once the request is surely in the engine
    s.close()
    busy, after = wait_idle(server)
    assert busy == (0, 0, 0, 0)
    key = 'deltaserve:request_success_total{finished_reason="abort"}'
    assert after[key] - before[key] == 1
    gen = "deltaserve:generation_tokens_total"
    assert after[gen] - before[gen] < 1000
