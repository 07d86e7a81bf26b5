"""Start-up and shutdown: SIGTERM with streams in flight ends them cleanly and exits 0."""

import http.client
import json
import signal
import threading
import time

from conftest import Server, sse_events


def test_sigterm_with_streams_in_flight():
    srv = Server("--max-num-seqs", "4", "--shutdown-timeout", "0.5")
    outcomes, tails = {}, {}
    started = threading.Barrier(5)  # the four streams and this thread

    def stream(i):
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": f"long {i}", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
             "stream": True}), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        events = sse_events(resp)
        first = next(events)
        started.wait()
        finish, done, tail = first["choices"][0]["finish_reason"], False, []
        for ev in events:
            tail = (tail + [ev])[-3:]
            if ev == "[DONE]":
                done = True
            else:
                finish = ev["choices"][0]["finish_reason"] or finish
        outcomes[i] = (finish, done)
        tails[i] = tail
        conn.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its first token: all four are running
    time.sleep(0.1)
    t0 = time.time()
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    rc = srv.stop()
    assert rc == 0, "".join(srv.log[-20:])
    assert time.time() - t0 < 10
    # every stream was ended by the server (aborted after the grace period), properly framed
    assert outcomes == {i: ("abort", True) for i in range(4)}, tails
    assert any("shutting down" in line for line in srv.log)
