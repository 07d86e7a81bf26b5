#!/usr/bin/env python3
"""The P/D transfer of a long prompt's state against UCX's own rate on the same link (issue 36,
docs/pd.md).

A producer prefills a TOKENS-token prompt (vllm-router's first request: max_tokens 1,
do_remote_decode) and a consumer pulls its state (the second request, with the producer's
kv_transfer_params). The consumer's /metrics say how many bytes the pull moved and how long they
took on the wire (kv_transfer_pull_bytes_total / kv_transfer_pull_seconds_total: the pull calls
alone, not the checks or the install). Beside it, in the same run, `ucx_perftest -t stream_bw`
between two processes of this machine with messages of the transfer's size: the transport's own
rate, with every transport UCX has (shared memory here) and with TCP alone (what UCX gives a
stream endpoint made from a socket address, as the pull's is). Each REPS times (a fresh prompt
each: nothing cached), alternating.

The model's context is raised for the run (a folder of links to --model's files whose config.json
says max_position_embeddings TOKENS + 256): gsm-k3's MLA layers take no positions (NoPE), so the
shapes and the bytes are the real ones; what the model says past its trained length is not the
point here.

    python3 bench/pd_xfer_bench.py --bin build/deltaserve --model models/gsm-k3 [--tokens 32768]
Prints a JSON record and a Markdown row.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pd_bench import PREFILL_KV, Srv  # noqa: E402


def long_model(src, tokens, dst):
    """dst: links to src's files, config.json with max_position_embeddings raised."""
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(dst, name))
    cfg = json.load(open(os.path.join(src, "config.json")))
    for c in (cfg, cfg.get("text_config", {})):
        if "max_position_embeddings" in c:
            c["max_position_embeddings"] = max(c["max_position_embeddings"], tokens + 256)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)


def perftest(size, iters, port, tls):
    """ucx_perftest stream_bw between two processes here, with UCX_TLS=tls: MB/s (10^6 bytes) of
    the final line."""
    env = dict(os.environ, UCX_TLS=tls)
    srv = subprocess.Popen(["ucx_perftest", "-p", str(port)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
    try:
        time.sleep(0.5)
        out = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", "stream_bw",
                              "-s", str(size), "-n", str(iters)], capture_output=True, text=True,
                             timeout=600, env=env).stdout
        final = [l for l in out.splitlines() if l.startswith("Final:")]
        if not final:
            raise RuntimeError("ucx_perftest printed no Final line:\n" + out)
        # Final: iterations, overhead 50% / average / overall (us), bandwidth average / overall
        return float(final[0].split()[6])
    finally:
        srv.kill()
        srv.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/deltaserve")
    ap.add_argument("--model", default="models/gsm-k3")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--extra", default="--kv-cache-memory 1G --kv-offload-ram 2G",
                    help="flags of both servers")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdx-")
    long_model(a.model, a.tokens, tmp)
    extra = shlex.split(a.extra) + ["--max-model-len", str(a.tokens + 256)]
    kv = lambda role: ["--kv-transfer-config", json.dumps({"kv_role": role})]  # noqa: E731
    prod = Srv(a.bin, tmp, extra + kv("kv_producer"))
    cons = Srv(a.bin, tmp, extra + kv("kv_consumer"))
    rec = {"args": vars(a), "cpus": os.cpu_count(), "load_average_before": os.getloadavg(),
           "pulls": [], "perftest_MBps": [], "perftest_tcp_MBps": []}
    try:
        model = json.loads(prod.get("/v1/models")[1])["data"][0]["id"]
        text = " ".join(f"Line {i}: a farmer sells {i % 23 + 2} crates of {i % 7 + 3} melons."
                        for i in range(4 * a.tokens // 15))
        ids = prod.tokenize(text)
        assert len(ids) >= a.tokens + a.reps, (len(ids), a.tokens)
        for r in range(a.reps):
            prompt = ids[r: r + a.tokens]  # a new first token: no shared prefix with the last
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            eb0 = prod.metric("kv_transfer_export_bytes_total")
            es0 = prod.metric("kv_transfer_export_seconds_total")
            t0 = time.time()
            kvp = prod.post(dict(body, kv_transfer_params=PREFILL_KV))["kv_transfer_params"]
            t_prefill = time.time() - t0
            # the producer's export: its blocks gathered from the pools (device to host when they
            # are on a GPU) into the part, and checksummed
            ebytes = prod.metric("kv_transfer_export_bytes_total") - eb0
            esecs = prod.metric("kv_transfer_export_seconds_total") - es0
            b0 = cons.metric("kv_transfer_pull_bytes_total")
            s0 = cons.metric("kv_transfer_pull_seconds_total")
            p0 = cons.metric("kv_transfer_pulls_total")
            t0 = time.time()
            cons.post(dict(body, kv_transfer_params=kvp))
            t_consumer = time.time() - t0
            assert cons.metric("kv_transfer_pulls_total") == p0 + 1, "the pull failed"
            nbytes = cons.metric("kv_transfer_pull_bytes_total") - b0
            secs = cons.metric("kv_transfer_pull_seconds_total") - s0
            rec["pulls"].append({"bytes": nbytes, "wire_s": secs, "MBps": nbytes / secs / 1e6,
                                 "export_bytes": ebytes, "export_s": esecs,
                                 "export_MBps": ebytes / esecs / 1e6 if esecs > 0 else None,
                                 "producer_prefill_s": t_prefill,
                                 "consumer_request_s": t_consumer})
            print(f"pull {r}: {nbytes / 1e6:.1f} MB in {secs:.3f} s = "
                  f"{nbytes / secs / 1e6:.0f} MB/s (prefill {t_prefill:.1f} s, consumer request "
                  f"{t_consumer:.2f} s); export {ebytes / 1e6:.1f} MB in {esecs:.3f} s", flush=True)
            # UCX's best here (shared memory between two processes), and TCP alone: the lane UCX
            # gives a stream endpoint made from a socket address (client-server mode), as the
            # pull's is (docs/pd.md)
            for key, tls in (("perftest_MBps", "all"), ("perftest_tcp_MBps", "tcp")):
                mbps = perftest(int(nbytes), 4, 13000 + 17 * r + os.getpid() % 1000, tls)
                rec[key].append(mbps)
                print(f"ucx_perftest stream_bw UCX_TLS={tls}, {nbytes / 1e6:.1f} MB messages: "
                      f"{mbps:.0f} MB/s", flush=True)
        rec["producer_held"] = prod.metric("kv_transfer_held")
        rec["load_average_after"] = os.getloadavg()
        pull = statistics.median(p["MBps"] for p in rec["pulls"])
        perf = statistics.median(rec["perftest_MBps"])
        tcp = statistics.median(rec["perftest_tcp_MBps"])
        rec["pull_over_perftest"] = pull / perf
        rec["pull_over_perftest_tcp"] = pull / tcp
        print(json.dumps(rec, indent=1))
        p = rec["pulls"][0]
        print("| prompt tokens | transfer MB | pull MB/s | ucx_perftest MB/s, all / tcp | "
              "pull / perftest, all / tcp |")
        print("|---|---|---|---|---|")
        print(f"| {a.tokens} | {p['bytes'] / 1e6:.1f} | {pull:.0f} | {perf:.0f} / {tcp:.0f} | "
              f"{pull / perf:.2f} / {pull / tcp:.2f} |")
    finally:
        for s in (prod, cons):
            s.stop()


if __name__ == "__main__":
    main()
