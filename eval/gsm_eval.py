#!/usr/bin/env python3
"""GSM-style accuracy eval of an OpenAI-compatible server (deltaserve, vLLM, ...).

Every test problem is sent as a few-shot /v1/completions request (greedy, stop at "\\n\\n") and
scored two ways, like lm-eval's gsm8k task:
  strict    the number on the first "#### N" line of the completion;
  flexible  the last number anywhere in the completion.
The server's /metrics (Prometheus text) is read before and after the run; with speculative
decoding on, the deltas give the draft acceptance rate and the tokens per forward.

python3 eval/gsm_eval.py --url http://127.0.0.1:8000/v1 --dataset tools/data/gsm_test.jsonl \\
    --num-concurrent 32 [--limit N] [--shots 4] [--model NAME] [--max-tokens 256] [--json OUT]
"""
import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "data"))
import gsm  # noqa: E402

DEFAULT_DATASET = os.path.join(ROOT, "tools", "data", "gsm_test.jsonl")
DEFAULT_FEWSHOT = os.path.join(ROOT, "tools", "data", "gsm_fewshot.jsonl")

# Same patterns as lm-eval's gsm8k filters: strict takes the first "#### N", flexible the last
# number-looking run (here it must hold a digit, so "..." or "$" alone never counts).
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEX = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


def _to_number(s):
    """'1,234.' -> 1234.0; None if it is not a number."""
    s = s.replace("$", "").replace(",", "").rstrip(".")
    try:
        return float(s)
    except ValueError:
        return None


def extract_strict(text):
    m = _STRICT.search(text)
    return _to_number(m.group(1)) if m else None


def extract_flexible(text):
    found = _FLEX.findall(text)
    return _to_number(found[-1]) if found else None


def is_correct(pred, answer):
    return pred is not None and math.isclose(pred, float(answer), abs_tol=1e-9)


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------------
# /metrics

# Counter names (after the "deltaserve:" / "vllm:" prefix); verifies = drafts = forwards that
# checked a draft. vLLM spells the first one num_drafts.
_SPEC = {"verifies": ("spec_decode_num_verifies_total", "spec_decode_num_drafts_total",
                      "spec_decode_num_drafts"),
         "draft_tokens": ("spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens"),
         "accepted_tokens": ("spec_decode_num_accepted_tokens_total",
                             "spec_decode_num_accepted_tokens"),
         "emitted_tokens": ("spec_decode_num_emitted_tokens_total",
                            "spec_decode_num_emitted_tokens"),
         "generation_tokens": ("generation_tokens_total",),
         "prompt_tokens": ("prompt_tokens_total",)}


def parse_metrics(text):
    """Prometheus text -> {name without prefix: value summed over label sets}. deltaserve exports
    every series twice (vllm: and deltaserve:): one prefix is read, vllm: when it is there."""
    out = {}
    prefix = "vllm:" if "\nvllm:" in "\n" + text else None
    for line in text.splitlines():
        if prefix and not line.startswith(prefix):
            continue
        if not line or line.startswith("#"):
            continue
        try:
            name_labels, value = line.rsplit(" ", 1)
            v = float(value)
        except ValueError:
            continue
        name = name_labels.split("{", 1)[0]
        name = name.rsplit(":", 1)[-1]
        out[name] = out.get(name, 0.0) + v
    return out


def fetch_metrics(base_url, timeout=10):
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    try:
        with urllib.request.urlopen(root + "/metrics", timeout=timeout) as r:
            return parse_metrics(r.read().decode("utf-8", "replace"))
    except Exception:  # a server without /metrics still gets evaluated
        return None


def spec_summary(before, after):
    if before is None or after is None:
        return None
    d = {}
    for key, names in _SPEC.items():
        for n in names:
            if n in after:
                d[key] = after[n] - before.get(n, 0.0)
                break
    s = {k: int(v) for k, v in d.items()}
    if d.get("draft_tokens"):
        s["acceptance_rate"] = d.get("accepted_tokens", 0.0) / d["draft_tokens"]
    if d.get("verifies"):
        s["tokens_per_forward"] = d.get("emitted_tokens", 0.0) / d["verifies"]
        s["mean_accepted_per_draft"] = d.get("accepted_tokens", 0.0) / d["verifies"]
    return s


# ------------------------------------------------------------------------------------------------
# The eval

def _stderr(p, n):
    return math.sqrt(p * (1 - p) / n) if n else 0.0


async def _run(base_url, problems, num_concurrent, shot_list, max_tokens, model, api_key,
               timeout, chat=False):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=1)
    try:
        if model is None:
            models = await client.models.list()
            model = models.data[0].id
        sem = asyncio.Semaphore(num_concurrent)

        async def one(i, p):
            prompt = gsm.few_shot_prompt(p["question"], shot_list)
            async with sem:
                try:
                    if chat:
                        r = await client.chat.completions.create(
                            model=model, temperature=0, max_tokens=max_tokens,
                            messages=[{"role": "user", "content": p["question"]}])
                    else:
                        r = await client.completions.create(model=model, prompt=prompt, temperature=0,
                                                            max_tokens=max_tokens, stop=["\n\n"])
                except Exception as e:  # counted and reported, never fatal
                    return {"index": i, "error": f"{type(e).__name__}: {e}"}
            ch = r.choices[0]
            usage = r.usage
            text = (ch.message.content or "") if chat else ch.text
            return {"index": i, "completion": text, "finish_reason": ch.finish_reason,
                    "completion_tokens": usage.completion_tokens if usage else None,
                    "prompt_tokens": usage.prompt_tokens if usage else None}

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    finally:
        await client.close()
    return model, results


def run_eval(base_url, problems, num_concurrent=32, shots=4, limit=None, max_tokens=256,
             model=None, api_key=None, fewshot=None, timeout=600.0, chat=False):
    """Evaluates problems (dicts with question, answer) against the server at base_url (".../v1").

    shots: how many of the few-shot examples (fewshot, default tools/data/gsm_fewshot.jsonl) go
    before each question. Returns a dict with both accuracies, their standard errors, counts,
    errors, timing, spec-decoding figures from /metrics and one record per problem."""
    if limit is not None:
        problems = problems[:limit]
    if fewshot is None:
        fewshot = load_jsonl(DEFAULT_FEWSHOT)
    if shots > len(fewshot):
        raise ValueError(f"asked for {shots} shots, only {len(fewshot)} available")
    shot_list = fewshot[:shots]
    api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    before = fetch_metrics(base_url)
    t0 = time.monotonic()
    model, results = asyncio.run(_run(base_url, problems, num_concurrent, shot_list, max_tokens,
                                      model, api_key, timeout, chat))
    wall = time.monotonic() - t0
    after = fetch_metrics(base_url)

    n = len(problems)
    strict = flexible = errors = gen_tokens = prompt_tokens = 0
    finish = {}
    records = []
    for p, r in zip(problems, results):
        rec = {"question": p["question"], "answer": p["answer"]}
        if "error" in r:
            errors += 1
            rec["error"] = r["error"]
        else:
            text = r["completion"]
            ps, pf = extract_strict(text), extract_flexible(text)
            rec.update(completion=text, finish_reason=r["finish_reason"], strict=ps, flexible=pf,
                       strict_correct=is_correct(ps, p["answer"]),
                       flexible_correct=is_correct(pf, p["answer"]))
            strict += rec["strict_correct"]
            flexible += rec["flexible_correct"]
            gen_tokens += r["completion_tokens"] or 0
            prompt_tokens += r["prompt_tokens"] or 0
            finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
        records.append(rec)
    # errors count as wrong: the accuracy is over every problem asked
    ps, pf = (strict / n, flexible / n) if n else (0.0, 0.0)
    return {"model": model, "base_url": base_url, "n": n, "shots": 0 if chat else shots,
            "mode": "chat" if chat else "completion",
            "max_tokens": max_tokens, "num_concurrent": num_concurrent,
            "strict_match": ps, "strict_match_stderr": _stderr(ps, n),
            "flexible_extract": pf, "flexible_extract_stderr": _stderr(pf, n),
            "strict_correct": strict, "flexible_correct": flexible, "errors": errors,
            "error_examples": [r["error"] for r in records if "error" in r][:5],
            "finish_reasons": finish, "wall_s": wall, "completion_tokens": gen_tokens,
            "completion_tokens_per_s": gen_tokens / wall if wall > 0 else 0.0,
            "mean_prompt_tokens": prompt_tokens / max(1, n - errors),
            "spec_decode": spec_summary(before, after), "records": records}


def print_report(r, out=sys.stdout):
    w = lambda s: print(s, file=out)  # noqa: E731
    w(f"model {r['model']} at {r['base_url']}: {r['n']} problems, "
      + ("chat, " if r.get("mode") == "chat" else f"{r['shots']}-shot, ")
      + f"max_tokens {r['max_tokens']}, concurrency {r['num_concurrent']}")
    w(f"strict-match     {r['strict_match']:.4f} ± {r['strict_match_stderr']:.4f} "
      f"({r['strict_correct']}/{r['n']})")
    w(f"flexible-extract {r['flexible_extract']:.4f} ± {r['flexible_extract_stderr']:.4f} "
      f"({r['flexible_correct']}/{r['n']})")
    w(f"errors {r['errors']}" + (f" (e.g. {r['error_examples'][0]})" if r["errors"] else "")
      + f"; finish reasons {r['finish_reasons']}")
    w(f"mean prompt {r.get('mean_prompt_tokens', 0):.0f} tokens; wall {r['wall_s']:.1f} s, "
      f"{r['completion_tokens']} completion tokens "
      f"({r['completion_tokens_per_s']:.1f} tok/s)")
    s = r["spec_decode"]
    if s is None:
        w("speculative decoding: /metrics not available")
    elif s.get("verifies"):
        w(f"speculative decoding: acceptance rate {s.get('acceptance_rate', 0):.3f} "
          f"({s.get('accepted_tokens', 0)}/{s.get('draft_tokens', 0)} draft tokens), "
          f"tokens per forward {s.get('tokens_per_forward', 0):.3f} over {s['verifies']} verifies")
    else:
        w("speculative decoding: off (no verify steps during the run)")


TIER_DIR = os.path.join(ROOT, "eval", "data", "tiers")
TIERS = ["indist", "paraphrase", "newstruct", "bignum"]


def load_tiers(spec):
    """--tiers value ("all" or a comma list) -> [(name, problems)] from eval/data/tiers/."""
    names = TIERS if spec == "all" else [t for t in spec.split(",") if t]
    out = []
    for t in names:
        path = os.path.join(TIER_DIR, f"{t}.jsonl")
        if not os.path.exists(path):
            raise SystemExit(f"--tiers: no tier {t!r} ({path} missing; tiers are {', '.join(TIERS)})")
        out.append((t, load_jsonl(path)))
    return out


def run_tiers(base_url, tiers, **kw):
    """run_eval on each tier separately: {tier: result}."""
    return {t: run_eval(base_url, probs, **kw) for t, probs in tiers}


def print_tier_table(res, out=sys.stdout):
    w = lambda s: print(s, file=out)  # noqa: E731
    w("| tier | n | prompt tokens | flexible | strict | acceptance | tokens / forward |")
    w("|---|---|---|---|---|---|---|")
    for t, r in res.items():
        w(f"| {t} | {r['n']} | {r.get('mean_prompt_tokens', 0):.0f} | {score_cells(r)} |")


def score_cells(r):
    """A result's table cells: flexible and strict accuracy with their standard errors, then the
    draft's acceptance and tokens per forward ("-" without speculation)."""
    s = r["spec_decode"] or {}
    acc = f"{s['acceptance_rate']:.3f}" if s.get("verifies") else "-"
    tpf = f"{s['tokens_per_forward']:.2f}" if s.get("verifies") else "-"
    return (f"{r['flexible_extract']:.4f} ± {r['flexible_extract_stderr']:.4f} "
            f"| {r['strict_match']:.4f} ± {r['strict_match_stderr']:.4f} | {acc} | {tpf}")


def main(argv=None):
    ap = argparse.ArgumentParser(description="GSM-style accuracy eval through the OpenAI API.")
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL ending in /v1")
    ap.add_argument("--dataset", default=DEFAULT_DATASET, help="JSON lines {question, answer}")
    ap.add_argument("--fewshot", default=DEFAULT_FEWSHOT, help="JSON lines of shot examples")
    ap.add_argument("--num-concurrent", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="only the first N problems")
    ap.add_argument("--shots", type=int, default=4)
    ap.add_argument("--model", default=None, help="default: the first id from /v1/models")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY or EMPTY")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--json", default=None, help="write the summary and every record here")
    ap.add_argument("--tiers", default=None, metavar="all|T1,T2",
                    help="score the held-out tiers of eval/data/tiers (" + ", ".join(TIERS)
                    + ") each separately instead of --dataset")
    ap.add_argument("--shots-sweep", default=None, metavar="K1,K2,...",
                    help="run each set once per shot count (prompt-length buckets for the draft's "
                         "acceptance; eval/data/shots40.jsonl as --fewshot gives up to ~2,000 tokens)")
    ap.add_argument("--chat", action="store_true",
                    help="ask each question as one /v1/chat/completions user message (no shots)")
    a = ap.parse_args(argv)
    if a.tiers or a.shots_sweep:
        sets = load_tiers(a.tiers) if a.tiers else [(os.path.basename(a.dataset), load_jsonl(a.dataset))]
        sweep = [int(x) for x in a.shots_sweep.split(",")] if a.shots_sweep else [a.shots]
        res = {}
        for name, probs in sets:
            for k in sweep:
                key = name if len(sweep) == 1 else f"{name} @{k} shots"
                res[key] = run_eval(a.url, probs, a.num_concurrent, k, a.limit, a.max_tokens,
                                    model=a.model, api_key=a.api_key, fewshot=load_jsonl(a.fewshot),
                                    timeout=a.timeout, chat=a.chat)
                print(f"--- {key}")
                print_report(res[key])
        print_tier_table(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    r = run_eval(a.url, load_jsonl(a.dataset), a.num_concurrent, a.shots, a.limit, a.max_tokens,
                 model=a.model, api_key=a.api_key, fewshot=load_jsonl(a.fewshot),
                 timeout=a.timeout, chat=a.chat)
    print_report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
