#!/usr/bin/env python3
"""The bundled model's GSM eval against a running server, with the standard library only (the GPU
machine has no `openai` package): the same few-shot prompts, greedy, stop at a blank line, and the
same strict / flexible scoring and /metrics summary as eval/gsm_eval.py, whose helpers it uses.

python3 tools/device/gpu_eval.py --url http://127.0.0.1:8101 [--limit N] [--concurrency 32]
"""
import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "eval"))
import gsm_eval  # noqa: E402  (its top level needs no openai)


def model_id(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def complete(url, model, prompt, max_tokens):
    body = json.dumps({"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                       "stop": ["\n\n"]}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out["choices"][0]["text"], out["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    probs = gsm_eval.load_jsonl(gsm_eval.DEFAULT_DATASET)[: a.limit]
    shots = gsm_eval.load_jsonl(gsm_eval.DEFAULT_FEWSHOT)[:4]
    model = model_id(a.url)
    before = gsm_eval.fetch_metrics(a.url)
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(a.concurrency) as ex:
        futs = [ex.submit(complete, a.url, model,
                          gsm_eval.gsm.few_shot_prompt(p["question"], shots), a.max_tokens)
                for p in probs]
        res = []
        for f in futs:
            try:
                res.append(f.result())
            except Exception as e:  # counted as wrong, never fatal
                res.append((None, 0, repr(e)))
    wall = time.monotonic() - t0
    after = gsm_eval.fetch_metrics(a.url)
    strict = flex = errors = toks = 0
    texts = []
    for p, r in zip(probs, res):
        if r[0] is None:
            errors += 1
            texts.append(None)
            continue
        text, n = r[0], r[1]
        texts.append(text)
        toks += n
        strict += gsm_eval.is_correct(gsm_eval.extract_strict(text), p["answer"])
        flex += gsm_eval.is_correct(gsm_eval.extract_flexible(text), p["answer"])
    n = len(probs)
    out = {"url": a.url, "n": n, "strict": strict / n, "flexible": flex / n, "errors": errors,
           "wall_s": round(wall, 2), "completion_tokens_per_s": round(toks / wall, 1),
           "spec_decode": gsm_eval.spec_summary(before, after), "texts": texts}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    print(json.dumps({k: v for k, v in out.items() if k != "texts"}))


if __name__ == "__main__":
    main()
