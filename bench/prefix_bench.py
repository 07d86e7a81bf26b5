#!/usr/bin/env python3
"""Prefix-cache benchmark (issue 4): time to first token of a request whose 2,048-token prefix is
cached, against cold, through the server; the warm case three ways: still on the device pools,
loaded back from the RAM tier, and from the disk tier (the device pools are flushed between by
filling them with other prompts).

    python3 bench/prefix_bench.py --bin build/deltaserve --model models/tiny-k3
"""
import argparse
import random
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

import http.client
import json


def ttft(port, ids):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0,
                       "stream": True})
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    first = None
    for line in r:
        if line.startswith(b"data: {") and first is None:
            first = time.perf_counter() - t0
        if line.startswith(b"data: [DONE]"):
            break
    c.close()
    return first


def serve(a, extra):
    p = subprocess.Popen([a.bin, "serve", "--model", a.model, "--port", str(a.port),
                          "--served-model-name", "m", *extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=1).status == 200:
                return p
        except Exception:
            time.sleep(0.2)
    raise SystemExit("server did not start")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/deltaserve")
    ap.add_argument("--model", default="models/tiny-k3")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--prefix", type=int, default=2048)
    a = ap.parse_args()
    rng = random.Random(5)
    prefix = [rng.randrange(700) for _ in range(a.prefix)]
    q1 = prefix + [rng.randrange(700) for _ in range(16)]
    q2 = prefix + [rng.randrange(700) for _ in range(16)]
    rows = []
    # cold vs warm on the device pools
    p = serve(a, ["--kv-cache-memory", "512M"])
    try:
        cold = ttft(a.port, q1)
        warm = ttft(a.port, q2)
        rows.append(("device pools", cold, warm))
    finally:
        p.terminate(); p.wait()
    # RAM and disk tiers: pools so small that other prompts push the prefix out of them
    with tempfile.TemporaryDirectory() as d:
        for name, extra in (("RAM tier", ["--kv-offload-ram", "1G"]),
                            ("disk tier", ["--kv-offload-disk-dir", d])):
            p = serve(a, ["--kv-cache-memory", "4M", "--state-checkpoint-memory", "1M",
                          "--max-num-seqs", "4", *extra])
            try:
                cold = ttft(a.port, q1)
                for i in range(6):  # flush the device pools
                    ttft(a.port, [rng.randrange(700) for _ in range(a.prefix + 16)])
                warm = ttft(a.port, q2)
                m = urllib.request.urlopen(f"http://127.0.0.1:{a.port}/metrics").read().decode()
                loads = sum(float(l.rsplit(" ", 1)[1]) for l in m.splitlines()
                            if l.startswith("deltaserve:kv_offload_loads_"))
                assert loads > 0, f"{name}: the warm request was not served from the tier"
                rows.append((name, cold, warm))
            finally:
                p.terminate(); p.wait()
    print(f"| prefix {a.prefix} tokens | cold TTFT ms | warm TTFT ms | speed-up |")
    print("|---|---|---|---|")
    for name, cold, warm in rows:
        print(f"| {name} | {1000*cold:.1f} | {1000*warm:.1f} | {cold/warm:.1f}x |")


if __name__ == "__main__":
    sys.exit(main())
