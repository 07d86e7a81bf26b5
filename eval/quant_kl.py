#!/usr/bin/env python3
"""What a quantized format costs in accuracy (issue 32): the bundled model's next-token
distributions under each format against its unquantized run, teacher-forced on the held-out test
problems (question and worked answer, the eval's text), at every position.

    python3 eval/quant_kl.py [--model models/gsm-k3] [--tokens 10000] [--formats ptpc_fp8,kv_fp8]

For each format: the mean KL(P_base || P_format) in nats over all positions (with its standard
error over positions), the share of positions whose greedy token is the same, and the largest
per-position KL. Logits come from `deltaserve logits` (one process, CPU unless DS_DEVICE says
otherwise), so the numbers are the engine's, not a reference's."""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gsm_eval  # noqa: E402

FORMATS = {  # name: flags of `deltaserve logits`
    "ptpc_fp8": ["--quantization", "ptpc_fp8"],
    "kv_fp8": ["--kv-cache-dtype", "fp8"],
    "ptpc_fp8+kv_fp8": ["--quantization", "ptpc_fp8", "--kv-cache-dtype", "fp8"],
}


def binary():
    return os.environ.get("DS_BIN", os.path.join(REPO, "build", "deltaserve"))


def tokenize(model, text):
    out = subprocess.run([binary(), "tokenize", "-m", model, "-t", text], check=True,
                         capture_output=True, text=True).stdout
    return [int(line.split("\t")[0]) for line in out.splitlines() if "\t" in line]


def logits(model, ids, flags, tmp):
    path = os.path.join(tmp, "l.npy")
    subprocess.run([binary(), "logits", "-m", model, "--token-ids", ",".join(map(str, ids)),
                    "-o", path, *flags], check=True, stdout=subprocess.DEVNULL)
    return np.load(path).astype(np.float64)


def log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "gsm-k3"))
    ap.add_argument("--tokens", type=int, default=10000, help="positions compared at least")
    ap.add_argument("--formats", default="ptpc_fp8,kv_fp8")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    probs = gsm_eval.load_jsonl(gsm_eval.DEFAULT_DATASET)
    seqs, n = [], 0
    for p in probs:
        ids = tokenize(a.model, f"Question: {p['question']}\nAnswer: {p['answer']}\n\n")
        seqs.append(ids)
        n += len(ids)
        if n >= a.tokens:
            break
    names = a.formats.split(",")
    kl = {f: [] for f in names}
    same = {f: 0 for f in names}
    with tempfile.TemporaryDirectory() as tmp:
        for ids in seqs:
            base = log_softmax(logits(a.model, ids, [], tmp))
            pb = np.exp(base)
            for f in names:
                q = log_softmax(logits(a.model, ids, FORMATS[f], tmp))
                kl[f].extend((pb * (base - q)).sum(axis=1).tolist())
                same[f] += int((base.argmax(axis=1) == q.argmax(axis=1)).sum())
    rows = []
    print(f"{n} positions of {len(seqs)} test problems, {a.model}")
    print("| format | mean KL (nats) | top-1 agreement | max KL |")
    print("|---|---|---|---|")
    for f in names:
        v = np.array(kl[f])
        se = v.std(ddof=1) / math.sqrt(len(v))
        row = {"format": f, "positions": len(v), "kl_mean": v.mean(), "kl_se": se,
               "top1": same[f] / len(v), "kl_max": v.max()}
        rows.append(row)
        print(f"| {f} | {v.mean():.5f} ± {se:.5f} | {same[f] / len(v):.4f} | {v.max():.3f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
