#!/usr/bin/env python3
"""The eval table of issue 7: the bundled model through `deltaserve serve` in each serving
configuration, one server at a time, every configuration on the same problems.

    python3 eval/run_table.py [--limit N] [--configs one,pp2tp4,...] [--out bench/eval_table.json]
        [--tiers all|indist,paraphrase,newstruct,bignum] [--bin BUILD/deltaserve] [--model DIR]

--tiers scores each held-out tier of eval/data/tiers (issue 37) separately under every
configuration, one row per configuration and tier.

Prints a markdown table (accuracy both ways with its standard error, acceptance and tokens per
forward where speculation is on, wall time) and writes every result as JSON."""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gsm_eval  # noqa: E402

SPEC = ["--speculative-method", "dspark", "--num-speculative-tokens", "7"]
CONFIGS = {  # name: (label, serve flags)
    "one": ("one process", ["--no-enable-prefix-caching"]),
    "pp2tp4": ("PP 2 x TP 4", ["-pp", "2", "-tp", "4", "--no-enable-prefix-caching"]),
    "spec": ("PP 2 x TP 4 + DSpark k=7", ["-pp", "2", "-tp", "4", "--no-enable-prefix-caching", *SPEC]),
    "prefix": ("+ prefix caching", ["-pp", "2", "-tp", "4", *SPEC]),
    "offload": ("+ RAM offload", ["-pp", "2", "-tp", "4", *SPEC, "--kv-offload-ram", "256M",
                                  "--kv-cache-memory", "48M"]),
    "one-spec": ("one process + DSpark k=7", SPEC),
    # the formats of docs/quantization.md, one process each
    "ptpc": ("one process, ptpc_fp8 weights", ["--no-enable-prefix-caching", "-q", "ptpc_fp8"]),
    "kvfp8": ("one process, FP8 latent cache", ["--no-enable-prefix-caching",
                                                "--kv-cache-dtype", "fp8"]),
    "ptpc-spec": ("PP 2 x TP 4 + DSpark k=7 + prefix, ptpc_fp8 + FP8 cache",
                  ["-pp", "2", "-tp", "4", *SPEC, "-q", "ptpc_fp8", "--kv-cache-dtype", "fp8"]),
}


def serve(args, port, binary=None, model=None):
    cmd = [binary or os.path.join(REPO, "build", "deltaserve"), "serve", "--model",
           model or os.path.join(REPO, "models", "gsm-k3"), "--port", str(port), "--kv-cache-memory",
           "512M", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return p
        except Exception:
            time.sleep(0.2)
    p.kill()
    raise RuntimeError("server did not start: " + " ".join(cmd))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--configs", default="one,pp2tp4,spec,prefix,offload")
    ap.add_argument("--port", type=int, default=8150)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "eval_table.json"))
    ap.add_argument("--tiers", default=None, metavar="all|T1,T2",
                    help="score the held-out tiers of eval/data/tiers separately (one row per "
                         "configuration and tier) instead of tools/data/gsm_test.jsonl")
    ap.add_argument("--bin", default=None, help="deltaserve executable (default build/deltaserve)")
    ap.add_argument("--model", default=None, help="model folder (default models/gsm-k3)")
    ap.add_argument("--fewshot", default=gsm_eval.DEFAULT_FEWSHOT)
    ap.add_argument("--tp", type=int, default=4,
                    help="TP width of the -tp configurations (a model whose heads 4 does not "
                         "divide needs 2)")
    a = ap.parse_args()
    sets = (gsm_eval.load_tiers(a.tiers) if a.tiers
            else [("gsm_test", gsm_eval.load_jsonl(gsm_eval.DEFAULT_DATASET))])
    shots = gsm_eval.load_jsonl(a.fewshot)
    rows = []
    first = {}  # tier -> the first configuration's completions, which every later one must equal
    for name in a.configs.split(","):
        label, args = CONFIGS[name]
        if a.tp != 4:
            args = [str(a.tp) if i and args[i - 1] == "-tp" else x for i, x in enumerate(args)]
            label = label.replace("TP 4", f"TP {a.tp}")
        p = serve(args, a.port, a.bin, a.model)
        try:
            for tier, probs in sets:
                r = gsm_eval.run_eval(f"http://127.0.0.1:{a.port}/v1", probs, 32, 4, a.limit, 256,
                                      fewshot=shots)
                outs = [x.get("completion") for x in r.pop("records")]
                ref = first.setdefault(tier, outs)
                r["same_as_first"] = sum(o is not None and o == w for o, w in zip(outs, ref))
                r["config"], r["flags"], r["tier"] = label, " ".join(args), tier
                rows.append(r)
                print(f"{label} [{tier}]: flexible {r['flexible_extract']:.4f} strict "
                      f"{r['strict_match']:.4f} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
                json.dump(rows, open(a.out, "w"), indent=1)
        finally:
            p.terminate()
            p.wait(timeout=60)
    print("| configuration | tier | flexible | strict | acceptance | tokens / forward "
          "| completions equal to the first row's | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['tier']} | {gsm_eval.score_cells(r)} "
              f"| {r['same_as_first']}/{r['n']} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
