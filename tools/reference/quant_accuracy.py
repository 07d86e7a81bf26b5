#!/usr/bin/env python3
"""Accuracy cost of the quantized formats in the float64 reference (issue 32): KL divergence of the
next-token distributions and top-1 agreement of each configuration against the unquantized model.

  KL = mean over positions of sum_v p(v) ln(p(v) / q(v)), p the unquantized model's softmax, q the
  quantized one's; top-1 = fraction of positions whose argmax agrees.

Also the golden sensitivity of ptpc_fp8: the same ptpc model with every quantized product's input
multiplied by (1 + e), e uniform in +-eps (what the C engine's f32 arithmetic does to activations
before it quantizes them), against the exact one: how far an implementation that is right up to f32
rounding can land from a ptpc golden once activation codes flip.

usage: quant_accuracy.py --model models/tiny-k3 [--num-tokens 2048] [--seed 7] [--sensitivity 1e-6,1e-7]
       quant_accuracy.py --model models/gsm-k3 --gsm-tokens 2000   # teacher-forced test problems, as
                                                                   # eval/quant_kl.py feeds the engine
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def kl_top1(p_logits, q_logits):
    lp = torch.log_softmax(p_logits, -1)
    lq = torch.log_softmax(q_logits, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (p_logits.argmax(-1) == q_logits.argmax(-1)).double().mean().item()
    return kl.mean().item(), kl.max().item(), top1


def gsm_sequences(model: str, n_tokens: int) -> list:
    """Token ids of the held-out test problems ("Question: ..\nAnswer: ..\n\n", as eval/quant_kl.py),
    one sequence each, until n_tokens positions; tokenized by `deltaserve tokenize` (build/)."""
    import json
    import subprocess
    root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    exe = os.environ.get("DS_BIN", os.path.join(root, "build", "deltaserve"))
    seqs, n = [], 0
    with open(os.path.join(root, "tools", "data", "gsm_test.jsonl")) as f:
        for line in f:
            p = json.loads(line)
            out = subprocess.run([exe, "tokenize", "-m", model, "-t",
                                  f"Question: {p['question']}\nAnswer: {p['answer']}\n\n"],
                                 check=True, capture_output=True, text=True).stdout
            seqs.append([int(x.split("\t")[0]) for x in out.splitlines() if "\t" in x])
            n += len(seqs[-1])
            if n >= n_tokens:
                break
    return seqs


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sensitivity", default="", help="comma-separated eps for the golden sensitivity run")
    ap.add_argument("--sensitivity-tokens", type=int, default=150)
    ap.add_argument("--gsm-tokens", type=int, default=0,
                    help="instead of random ids: test problems of tools/data/gsm_test.jsonl, this many positions")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    import quant as Q
    from model import ReferenceModel

    V = ReferenceModel.from_dir(a.model).cfg.vocab_size
    if a.gsm_tokens:
        seqs = gsm_sequences(a.model, a.gsm_tokens)
        what = f"{sum(map(len, seqs))} positions of {len(seqs)} GSM test problems"
    else:
        seqs = [np.random.default_rng(a.seed).integers(0, V, size=a.num_tokens)]
        what = f"T={a.num_tokens} random ids, seed {a.seed}"
    ids = seqs[0]

    def run(ref):
        return torch.cat([ref.forward(s).logits for s in seqs], 0)
    t0 = time.time()
    base = run(ReferenceModel.from_dir(a.model))
    lp = torch.log_softmax(base, -1)
    ent = -(lp.exp() * lp).sum(-1).mean().item()
    print(f"{a.model}: {what}; unquantized mean entropy {ent:.3f} nats "
          f"(uniform {np.log(V):.3f}) [{time.time() - t0:.0f} s]", flush=True)
    for name, kw in (("ptpc_fp8", dict(quantization="ptpc_fp8")), ("fp8 KV", dict(kv_cache_dtype="fp8")),
                     ("ptpc_fp8 + fp8 KV", dict(quantization="ptpc_fp8", kv_cache_dtype="fp8"))):
        q = run(ReferenceModel.from_dir(a.model, **kw))
        kl, klmax, top1 = kl_top1(base, q)
        print(f"  {name:18s} KL mean {kl:.3e} max {klmax:.3e} nats; top-1 agreement {100 * top1:.2f} %; "
              f"logits max rel diff {rel(q, base):.3g}", flush=True)
    if a.sensitivity:
        ids_s = ids[: a.sensitivity_tokens]
        ref = ReferenceModel.from_dir(a.model, quantization="ptpc_fp8")
        exact = ref.forward(ids_s)
        orig = Q.QMat.matmul
        for eps in [float(e) for e in a.sensitivity.split(",")]:
            g = torch.Generator().manual_seed(11)

            def noisy(self, x, eps=eps, g=g):
                u = (torch.rand(x.shape, generator=g, dtype=torch.float64) * 2 - 1) * eps
                return orig(self, x * (1 + u))
            Q.QMat.matmul = noisy
            try:
                pert = ref.forward(ids_s)
            finally:
                Q.QMat.matmul = orig
            eh = max(rel(p, e) for p, e in zip(pert.hidden, exact.hidden))
            print(f"  sensitivity, inputs x (1 +- {eps:g}), T={len(ids_s)}: logits rel {rel(pert.logits, exact.logits):.3g}, "
                  f"final_hidden {rel(pert.final_hidden, exact.final_hidden):.3g}, worst hidden {eh:.3g}; "
                  f"top-1 changed at {(pert.logits.argmax(-1) != exact.logits.argmax(-1)).sum().item()} "
                  f"of {len(ids_s)} positions", flush=True)


if __name__ == "__main__":
    main()
