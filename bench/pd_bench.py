#!/usr/bin/env python3
"""Prefill/decode disaggregation benchmark (issue 36, docs/pd.md) on one machine.

Starts a plain server, a producer and a consumer of the same model (same flags but the role) and
sends requests the way vllm-router's P/D mode does (the producer gets max_tokens 1, stream false
and do_remote_decode; the consumer the original request with the producer's kv_transfer_params).

  ttft:  time to first token of a streamed completion of N prompt tokens, through the pair
         (producer's answer + consumer's first token) against the plain server, each prompt new
         (a different first token, so no prefix is shared). The servers are idle otherwise.
  --split-cores pins the producer and the consumer to a core each (one thread each), so the
  long prompts' prefill cannot take the decode streams' core; without it both processes float
  over all cores with the default thread count.

  mixed: D decode streams (short prompts, long outputs) run while long prompts arrive every few
         seconds; the decode streams' inter-token latency (gaps between streamed tokens after the
         first) p50/p99/max, with every request on the one server against every request through
         the pair (the long prompts' prefill then runs in the producer's process, their decode and
         the streams' decode in the consumer's). Both processes share the machine's cores.

    python3 bench/pd_bench.py --bin build/deltaserve --model models/gsm-k3 [--lengths 500,2000,4000]
        [--producer-extra "-pp 2"] [--consumer-extra "-tp 2"]  (each side's own layout)
Prints a JSON record and Markdown tables.
"""
import argparse
import http.client
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


class Srv:
    def __init__(self, binary, model, extra, prefix=(), threads=None):
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        self.proc = subprocess.Popen([*prefix, binary, "serve", "--model", model, "--port", "0",
                                      "--seed", "1", *extra], stdout=subprocess.PIPE, env=env,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.port, self.log = None, []
        seen = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                m = re.search(r"listening on \S+:(\d+)", line)
                if m and not seen.is_set():
                    self.port = int(m.group(1))
                    seen.set()
            seen.set()
        threading.Thread(target=pump, daemon=True).start()
        if not seen.wait(120) or self.port is None:
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        for _ in range(1200):
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server never became healthy:\n" + "".join(self.log))

    def get(self, path):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()

    def post(self, body):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        data = json.loads(r.read())
        assert r.status == 200, data
        return data

    def tokenize(self, text):
        """The server's token ids of text (its /tokenize)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        c.request("POST", "/tokenize", json.dumps({"prompt": text}),
                  {"Content-Type": "application/json"})
        return json.loads(c.getresponse().read())["tokens"]

    def stream(self, body):
        """Arrival times (time.perf_counter) of each streamed chunk that carries text."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200, r.read()
        times = []
        for line in r:
            if line.startswith(b"data: {"):
                ch = json.loads(line[6:])
                if ch.get("choices") and ch["choices"][0].get("text"):
                    times.append(time.perf_counter())
        return times

    def metric(self, name):
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith("vllm:" + name):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def body(model, ids, max_tokens):
    return {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def run_one(plain, pair, b):
    """Streamed token times of request b, from the plain server or (pair) through the pair."""
    t0 = time.perf_counter()
    if pair:
        prod, cons = pair
        kv = prod.post(dict(b, max_tokens=1, kv_transfer_params=PREFILL_KV))["kv_transfer_params"]
        return t0, cons.stream(dict(b, kv_transfer_params=kv))
    return t0, plain.stream(b)


def ttft(a, plain, pair, ids, model):
    rows = []
    for n in a.lengths:
        one, two = [], []
        for k in range(a.reps):
            off = 1 + 3 * k + n % 97  # a new first token for every prompt: nothing cached
            b = body(model, ids[off: off + n], 4)
            t0, times = run_one(plain, None, b)
            one.append(times[0] - t0)
            b = body(model, ids[off + 1: off + 1 + n], 4)
            t0, times = run_one(plain, pair, b)
            two.append(times[0] - t0)
        rows.append({"prompt_tokens": n, "one_server_s": statistics.median(one),
                     "pair_s": statistics.median(two), "one_all": one, "pair_all": two})
    return rows


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def mixed(a, plain, pair, ids, model):
    """D decode streams while long prompts arrive; the streams' token gaps in seconds."""
    gaps, long_ttft, errors = [], [], []
    stop_at = time.perf_counter() + a.mixed_s

    def stream_loop(k):
        j = 0
        while time.perf_counter() < stop_at:
            off = 2000 + 37 * k + j  # short prompts of their own
            try:
                _, t = run_one(plain, pair, body(model, ids[off: off + 64], a.decode_tokens))
            except Exception as e:  # noqa: BLE001 (reported, not hidden)
                errors.append(repr(e))
                return
            gaps.extend(y - x for x, y in zip(t, t[1:]))
            j += 1

    def long_loop():
        k = 0
        time.sleep(a.long_every_s / 2)
        while time.perf_counter() < stop_at - a.long_every_s / 2:
            off = 5 + 11 * k
            try:
                t0, t = run_one(plain, pair, body(model, ids[off: off + a.long_tokens], 8))
                long_ttft.append(t[0] - t0)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
            k += 1
            time.sleep(a.long_every_s)

    th = [threading.Thread(target=stream_loop, args=(k,)) for k in range(a.decode_streams)]
    th.append(threading.Thread(target=long_loop))
    for t in th:
        t.start()
    for t in th:
        t.join()
    return {"gaps": len(gaps), "itl_p50_ms": 1e3 * pct(gaps, 0.5),
            "itl_p99_ms": 1e3 * pct(gaps, 0.99), "itl_max_ms": 1e3 * max(gaps, default=0),
            "long_prompts": len(long_ttft),
            "long_ttft_median_s": statistics.median(long_ttft) if long_ttft else None,
            "errors": errors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/deltaserve")
    ap.add_argument("--model", default="models/gsm-k3")
    ap.add_argument("--extra", default="--kv-cache-memory 256M", help="flags of all three servers")
    ap.add_argument("--lengths", default="500,2000,4000")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--mixed-s", type=float, default=60)
    ap.add_argument("--decode-streams", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--long-every-s", type=float, default=8)
    ap.add_argument("--split-cores", action="store_true",
                    help="pin the producer to core 0 and the consumer to core 1, one OpenMP thread "
                    "each (the plain server keeps both cores): prefill cannot take decode's core")
    ap.add_argument("--skip", default="", help="ttft or mixed: leave that part out")
    ap.add_argument("--producer-extra", default="", help="the producer's own flags (e.g. -pp 2)")
    ap.add_argument("--consumer-extra", default="", help="the consumer's own flags (e.g. -tp 2)")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    extra = shlex.split(a.extra)
    kv = lambda role: ["--kv-transfer-config", json.dumps({"kv_role": role})]  # noqa: E731
    plain = Srv(a.bin, a.model, extra)
    pin = (lambda c: ("taskset", "-c", str(c))) if a.split_cores else (lambda c: ())
    one = 1 if a.split_cores else None
    prod = Srv(a.bin, a.model, extra + shlex.split(a.producer_extra) + kv("kv_producer"), pin(0),
               one)
    cons = Srv(a.bin, a.model, extra + shlex.split(a.consumer_extra) + kv("kv_consumer"), pin(1),
               one)
    try:
        model = json.loads(plain.get("/v1/models")[1])["data"][0]["id"]
        ids = plain.tokenize(" ".join(
            f"Q{i}: Tom has {i % 17 + 2} apples and buys {i % 5 + 3} more; how many now?"
            for i in range(800)))
        assert len(ids) > max(a.lengths) + 100 and len(ids) > 2400, len(ids)
        for s in (plain, cons):  # warm-up: first-touch of weights and pools
            run_one(s, None, body(model, ids[3000:3040], 4))
        run_one(plain, (prod, cons), body(model, ids[3100:3140], 4))
        rec = {"load_average_before": os.getloadavg(), "split_cores": a.split_cores,
               "cpus": os.cpu_count(), "args": vars(a)}
        if a.skip != "ttft":
            rec["ttft"] = ttft(a, plain, (prod, cons), ids, model)
        if a.skip != "mixed":
            rec["mixed_one_server"] = mixed(a, plain, None, ids, model)
            rec["mixed_pair"] = mixed(a, plain, (prod, cons), ids, model)
        rec["load_average_after"] = os.getloadavg()
        rec["consumer_pulls"] = cons.metric("kv_transfer_pulls_total")
        rec["consumer_pull_failures"] = cons.metric("kv_transfer_pull_failures_total")
        rec["producer_held"] = prod.metric("kv_transfer_held")
        print(json.dumps(rec, indent=1))
        if "ttft" in rec:
            print("| prompt tokens | TTFT one server s | TTFT through the pair s | pair / one |")
            print("|---|---|---|---|")
            for r in rec["ttft"]:
                print(f"| {r['prompt_tokens']} | {r['one_server_s']:.3f} | {r['pair_s']:.3f} | "
                      f"{r['pair_s'] / r['one_server_s']:.2f} |")
        if "mixed_pair" in rec:
            print("| setup | decode ITL p50 ms | p99 ms | max ms | gaps | long prompts | "
                  "long TTFT median s |")
            print("|---|---|---|---|---|---|---|")
            for k in ("mixed_one_server", "mixed_pair"):
                r = rec[k]
                lt = r["long_ttft_median_s"]
                print(f"| {k[6:]} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
                      f"{r['itl_max_ms']:.1f} | {r['gaps']} | {r['long_prompts']} | "
                      f"{lt if lt is None else round(lt, 2)} |")
    finally:
        for s in (plain, prod, cons):
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
