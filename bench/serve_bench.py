#!/usr/bin/env python3
"""Serving benchmark (issue 3): starts `deltaserve serve` on a model, runs `deltaserve bench serve`
at several concurrencies, and reports output tokens/s, TPOT and the server overhead — the share
of the benchmark's wall time the engine did not spend inside forward passes and sampling
(HTTP, tokenisation, scheduling, waiting), read from the server's own step counters.

    python3 bench/serve_bench.py --bin build/deltaserve --model models/tiny-k3 [--extra "..."]
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r"\{.*\}", "", key)] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/deltaserve")
    ap.add_argument("--model", default="models/tiny-k3")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--extra", default="", help="more serve flags")
    ap.add_argument("--server-prefix", default="",
                    help="command put before the server only, e.g. 'taskset -c 0' to pin it")
    a = ap.parse_args()
    srv = subprocess.Popen([*shlex.split(a.server_prefix), a.bin, "serve", "--model", a.model, "--port", str(a.port),
                            "--max-num-seqs", "64", "--kv-cache-memory", "256M",
                            *shlex.split(a.extra)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=1).status == 200:
                    break
            except Exception:
                time.sleep(0.2)
        rows = []
        for c in [int(x) for x in a.concurrency.split(",")]:
            n = max(16, 2 * c)
            before = metrics(a.port)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([a.bin, "bench", "serve", "--url", f"http://127.0.0.1:{a.port}",
                                "--num-prompts", str(n), "--concurrency", str(c),
                                "--input-len", str(a.input_len), "--output-len",
                                str(a.output_len), "--out", f.name],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                r = json.load(open(f.name))
            after = metrics(a.port)
            step = after["deltaserve:engine_step_seconds_total"] - before["deltaserve:engine_step_seconds_total"]
            ver = after.get("deltaserve:spec_decode_num_verifies_total", 0) - before.get("deltaserve:spec_decode_num_verifies_total", 0)
            emitted = after.get("deltaserve:spec_decode_num_emitted_tokens_total", 0) - before.get("deltaserve:spec_decode_num_emitted_tokens_total", 0)
            drafts = after.get("deltaserve:spec_decode_num_draft_tokens_total", 0) - before.get("deltaserve:spec_decode_num_draft_tokens_total", 0)
            acc = after.get("deltaserve:spec_decode_num_accepted_tokens_total", 0) - before.get("deltaserve:spec_decode_num_accepted_tokens_total", 0)
            rows.append({"concurrency": c, "output_tps": r["output_throughput"],
                         "mean_tpot_ms": r["mean_tpot_ms"], "mean_ttft_ms": r["mean_ttft_ms"],
                         "duration_s": r["duration"], "engine_step_s": step,
                         "overhead_frac": 1 - step / r["duration"],
                         "acceptance": acc / drafts if drafts else None,
                         "tokens_per_verify": emitted / ver if ver else None})
        print(json.dumps(rows, indent=1))
        base = rows[0]["output_tps"]
        print("| concurrency | output tok/s | x conc 1 | mean TPOT ms | mean TTFT ms | overhead | acceptance | tokens/verify |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            tpv = f"{r['tokens_per_verify']:.2f}" if r["tokens_per_verify"] is not None else "-"
            print(f"| {r['concurrency']} | {r['output_tps']:.1f} | {r['output_tps']/base:.2f} | "
                  f"{r['mean_tpot_ms']:.2f} | {r['mean_ttft_ms']:.1f} | {100*r['overhead_frac']:.1f}% | {acc} | {tpv} |")
    finally:
        srv.terminate()
        srv.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
