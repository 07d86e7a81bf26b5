#!/usr/bin/env python3
"""Checks a trained model folder (and optionally its draft) in the C engine.

  1. tokenizer: `deltaserve tokenize` ids == tools/train/tok.py ids on a GSM prompt;
  2. target: `deltaserve logits` vs the float64 reference (tools/reference/model.py) on that prompt
     plus random ids: max rel err (docs/architecture.md invariant 2: <= 1e-4), and the argmax agreement;
     the trainer's own fp32 k3_torch vs the reference, for scale;
  3. draft (--draft): `deltaserve serve --speculative-method dspark` greedy completion of the prompt,
     its /metrics acceptance counters vs this trainer's Python simulation of the same speculative
     decode (fp32 k3_torch + dspark_torch), and the text vs plain greedy.

usage: check_c_engine.py --model DIR [--draft DIR] [--bin build-helperB/deltaserve] [--k 7] [--max-tokens 48]
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))

import data  # noqa: E402
from model import ReferenceModel  # noqa: E402
from tok import Tokenizer  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def c_logits(binary, model, ids):
    with tempfile.TemporaryDirectory() as td:
        out = os.path.join(td, "l.npy")
        subprocess.run([binary, "logits", "--model", model, "--token-ids", ",".join(map(str, ids)), "--out", out],
                       check=True, capture_output=True, text=True)
        return np.load(out)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def http(url, body=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


def serve_completion(binary, model, draft, k, prompt, max_tokens):
    port = free_port()
    cmd = [binary, "serve", "--model", model, "--port", str(port), "--host", "127.0.0.1"]
    if draft:
        cmd += ["--speculative-method", "dspark", "--draft-model", draft, "--num-speculative-tokens", str(k)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                http(base + "/health")
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError("serve exited: " + proc.stdout.read()[-2000:])
                time.sleep(0.1)
        res = json.loads(http(base + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0, "ignore_eos": True}))
        metrics = http(base + "/metrics")
    finally:
        proc.send_signal(signal.SIGINT)  # only the server this script started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    m = {}
    for line in metrics.splitlines():
        mm = re.match(r"deltaserve:(spec_decode_\w+?)(?:\{([^}]*)\})? ([0-9.eE+-]+)$", line)
        if mm:
            name, labels, val = mm.group(1), mm.group(2) or "", float(mm.group(3))
            pos = re.search(r'position="(\d+)"', labels)
            m[name + (f"[{pos.group(1)}]" if pos else "")] = val
    return res["choices"][0]["text"], m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build-helperB", "deltaserve"))
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--shots", type=int, default=2)
    ap.add_argument("--gsm", default=None, help="data generator of the test prompt (default tools/data/gsm.py)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tok = Tokenizer(a.model)
    gsm = data.load_gsm(a.gsm)
    ids, _ = data.eval_prompts(gsm, tok, 1, seed=data.EVAL_SEED + 11, shots=a.shots, split="test")[0]
    prompt = tok.decode(ids)

    out = subprocess.run([a.bin, "tokenize", "--model", a.model, "--text", prompt], check=True,
                         capture_output=True, text=True).stdout
    c_ids = [int(x) for x in out.splitlines()[0].split(":", 1)[1].split(",")]
    print(f"tokenizer: C {'==' if c_ids == ids else '!='} tiktoken ({len(ids)} ids)")

    ref = ReferenceModel.from_dir(a.model)
    assert not ref.w.unused(), f"unused tensors: {ref.w.unused()[:5]}"
    rnd = np.random.default_rng(1).integers(0, ref.cfg.vocab_size, size=150).tolist()
    worst = 0.0
    for name, seq in (("gsm prompt", ids), ("random ids", rnd)):
        with torch.no_grad():
            r = ref.forward(seq).logits.numpy()
        c = c_logits(a.bin, a.model, seq)
        e = rel(c, r)
        worst = max(worst, e)
        agree = float((c.argmax(-1) == r.argmax(-1)).mean())
        print(f"target logits, {name} (T={len(seq)}): C engine vs float64 reference max rel err {e:.2e}, "
              f"argmax agreement {agree:.4f}")
    from k3_torch import load_k3

    mine = load_k3(a.model, dtype=torch.float32)
    with torch.no_grad():
        r = ref.forward(ids).logits.numpy()
        p = mine(torch.tensor([ids]))["logits"][0].numpy()
    print(f"target logits: trainer fp32 k3_torch vs float64 reference max rel err {rel(p, r):.2e}")

    if a.draft:
        from dspark_torch import DSparkDraft
        from k3_torch import load_safetensors_dir
        import train

        with open(os.path.join(a.draft, "config.json")) as f:
            draft = DSparkDraft(json.load(f))
        draft.load_state_dict(load_safetensors_dir(a.draft))
        draft.eval()
        dev = torch.device("cpu")
        gens, hist, passes, emitted = train.spec_sim(mine, draft, mine.lm.head_weight().detach(), [ids], a.k,
                                                     a.max_tokens, dev, tok, stop="\x00never")
        greedy = train.greedy_generate(mine, [ids], a.max_tokens, dev, tok, stop="\x00never")[0]
        text, m = serve_completion(a.bin, a.model, a.draft, a.k, prompt, a.max_tokens)
        verifies = m.get("spec_decode_num_verifies_total", 0)
        emitted_c = m.get("spec_decode_num_emitted_tokens_total", 0)
        per_pos = [int(m.get(f"spec_decode_num_accepted_tokens_per_pos[{i}]", 0)) for i in range(a.k)]
        py_per_pos = [int(sum(hist[j] for j in range(i + 1, a.k + 1))) for i in range(a.k)]
        print(f"draft: C engine serve (dspark, K={a.k}, {a.max_tokens} tokens): {verifies:.0f} verifies, "
              f"{emitted_c / max(verifies, 1):.3f} tokens/forward, accepted per position {per_pos}")
        print(f"draft: trainer simulation (fp32):            {passes} verifies, "
              f"{emitted / max(passes, 1):.3f} tokens/forward, accepted per position {py_per_pos}")
        py_text = tok.decode(gens[0][: a.max_tokens])
        print(f"draft: C text {'==' if text == py_text else '!='} simulated text; "
              f"simulated {'==' if gens[0][:a.max_tokens] == greedy[:a.max_tokens] else '!='} plain greedy")
        if text != py_text:
            print("  C  : " + repr(text[:200]) + "\n  py : " + repr(py_text[:200]))
    print(f"max C-vs-reference logits rel err {worst:.2e}")


if __name__ == "__main__":
    main()
