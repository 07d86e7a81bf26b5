#!/usr/bin/env python3
"""bench/latest.json: the current headline figures in one machine-readable file (issue 33).

Each key names a figure (`h200.decode_b1_copy_fraction`, `cpu.decode_b1_read_fraction`, ...) and
holds {"value", "commit", "date", "machine", "source"}: the benchmark scripts call this after a
run, so the file always says which commit and day a figure comes from, and a key nobody has
measured yet is absent rather than stale or invented. bench/RESULTS.md keeps the history and the
reading of the figures; this file is for dashboards and regressions checks.

    bench_latest.py [--latest F] [--prefix h200] [--commit C] [--machine TEXT] SOURCE...

SOURCE is one of
    bench:FILE        a `deltaserve bench --json` result
    serve:LABEL:FILE  a `deltaserve bench serve --out` result, a row of the serving table
    kda:FILE          the log of tools/device/kda_vs_fla.sh (ours, the model's default form,
                      against FLA's chunk_kda: kda_chunk_vs_fla_bf16 and _f32; our BF16 mode
                      against FLA's bf16: kda_chunk_vs_fla_bf16_bf16mode; with varlen lines also
                      kda_chunk_varlen_<n>x<L>_vs_fla_bf16[_bf16mode])

Keys from a `bench` result (only those its settings measure):
    decode_b1_copy_fraction            batch 1, graphs, context <= 4096, the model's own weights
    decode_b1_<quant>_copy_fraction    the same with --quantization <quant>
    decode_128k_context_copy_fraction  batch 1 at a context >= 131072 (1m: >= 1,000,000)
    prefill_<N>_gemm_fraction          prompt of N tokens: GEMM FLOPs over time against the
                                       measured GEMM rate (N = 8192 is the issue's figure)
    prefill_<N>_peak_fraction          CPU: the prompt's FLOPs over time against the FMA peak
    prefill_<N>_whole_fraction         GPU: the whole prompt's FLOPs over its time against the
                                       measured GEMM rate (issue 33's prompt figure)
    prefill_<N>_<quant>_whole_fraction the same with --quantization <quant> (its FLOPs counted as
                                       BF16's, so its ratio to the key above is the speed-up)
    ... and <key>_ms beside each decode fraction, ttft_<N>k_s for prompts of >= 128K tokens
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys


class BenchError(Exception):
    """A source that cannot be read or does not hold what its kind promises."""


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: {e}") from e


def need(d, keys, path):
    missing = [k for k in keys if k not in d]
    if missing:
        raise BenchError(f"{path}: not a bench result (missing {', '.join(missing)})")


def from_bench(path):
    """Keys a `deltaserve bench --json` result measures: {key: (value, detail)}."""
    d = load_json(path)
    need(d, ["model", "quantization", "prompt_tokens", "decode", "decode_context", "cuda_graphs"],
         path)
    out = {}
    q = d["quantization"]
    qtag = "" if q in ("none", "") else f"{q}_"
    kv = d.get("kv_cache_dtype", "auto")
    kvtag = "" if kv in ("auto", "") else f"_kv{kv}"
    model = os.path.basename(d["model"].rstrip("/"))
    n = d["prompt_tokens"]
    ctx = d["decode_context"]
    # the prompt fractions come from the headline runs (a short decode context, the model's own
    # cache dtype); a long-context run's prompt is the set-up of its decode, timed once
    prompt_headline = not qtag and ctx <= 4096 and not kvtag
    if d.get("prompt_gemm_frac_peak", 0) > 0 and prompt_headline:
        out[f"prefill_{n}_gemm_fraction"] = (d["prompt_gemm_frac_peak"],
                                             f"{model}: prompt {n}, {d['prompt_tps']:.0f} tok/s")
    if d["device"].startswith("cpu") and d.get("prompt_frac_peak", 0) > 0 and prompt_headline:
        out[f"prefill_{n}_peak_fraction"] = (d["prompt_frac_peak"],
                                             f"{model}: prompt {n}, {d['prompt_tps']:.1f} tok/s")
    elif d.get("prompt_frac_peak", 0) > 0 and prompt_headline:  # a GPU: issue 33's prompt figure
        out[f"prefill_{n}_whole_fraction"] = (
            d["prompt_frac_peak"],
            f"{model}: prompt {n}, {d['prompt_tps']:.0f} tok/s, the whole prompt's FLOPs over its "
            "time against the measured cuBLAS BF16 rate")
    # (a quantized run's prompt counts from 4096 tokens: the decode runs' short prompts are their
    # set-up, timed once)
    quant_headline = qtag and ctx <= 4096 and not kvtag and n >= 4096
    if (quant_headline and not d["device"].startswith("cpu") and
            d.get("prompt_frac_peak", 0) > 0):
        out[f"prefill_{n}_{qtag}whole_fraction"] = (
            d["prompt_frac_peak"],
            f"{model}: prompt {n}, {d['prompt_tps']:.0f} tok/s with --quantization {q}, the whole "
            "prompt's FLOPs over its time against the measured cuBLAS BF16 rate")
    if n >= 131072 and d.get("prompt_tps", 0) > 0:
        out[f"ttft_{n // 1024}k_s{kvtag}"] = (n / d["prompt_tps"], f"{model}: prompt {n}")
    if ctx >= 1000000:
        ctag = "1m_context_"
    elif ctx >= 131072:
        ctag = "128k_context_"
    elif ctx <= 4096:
        ctag = "b1_"
    else:
        ctag = None
    for row in d["decode"]:
        if row["batch"] != 1 or ctag is None or row.get("frac_bw", 0) <= 0:
            continue
        if d["device"].startswith("cpu"):
            key = f"decode_{ctag}{qtag}read_fraction{kvtag}"
        elif d["cuda_graphs"]:
            key = f"decode_{ctag}{qtag}copy_fraction{kvtag}"
        else:
            continue  # eager GPU steps are a diagnosis, not the headline
        detail = f"{model}: context {ctx}, {row['ms_per_step']:.3f} ms, {row['gbs']:.0f} GB/s"
        out[key] = (row["frac_bw"], detail)
        out[key.replace("_fraction", "_ms")] = (row["ms_per_step"], detail)
    return out


def from_serve(label, path):
    """A row of the serving table: throughput and latency percentiles of one bench serve run."""
    d = load_json(path)
    need(d, ["completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms"], path)
    if d["failed"]:
        raise BenchError(f"{path}: {d['failed']} requests failed; not a figure to publish")
    row = {k: d[k] for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                             "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
           if k in d}
    return {f"serve.{label}": (row, f"{d['completed']} requests")}


KDA_OURS = re.compile(r"bench kda chunked prefill T=(\d+) H=(\d+) dk=dv=(\d+)([^:]*): ([\d.]+) ms")
# the BF16 mode's own form (the scan making the outputs, pass 1 in f32)
KDA_BF16_FORM = " (bf16 scan and outputs, pass 1 f32)"
KDA_DEFAULT = re.compile(r"bench kda chunked prefill T=(\d+) H=(\d+) dk=dv=(\d+) \([^)]*, default\): "
                         r"([\d.]+) ms")
KDA_FLA = re.compile(r"fla chunk_kda T=(\d+) H=(\d+) dk=dv=(\d+) (\w+): ([\d.]+) ms")
# varlen: n sequences of L tokens in one call, ours in a scan mode (3xbf16: the model's default
# since session 47, 3xtf32 before it; bf16) against FLA's bf16 run with cu_seqlens
KDA_VAR_OURS = re.compile(r"bench kda chunked varlen (\d+) x (\d+) H=\d+ dk=dv=\d+ \((\w+) scan[^)]*\): "
                          r"([\d.]+) ms")
KDA_VAR_FLA = re.compile(r"fla chunk_kda varlen (\d+) x (\d+) H=\d+ dk=dv=\d+ bfloat16: ([\d.]+) ms")


def from_kda(path):
    """FLA's chunk_kda time over ours on the same shape (> 1: ours is faster)."""
    try:
        text = open(path).read()
    except OSError as e:
        raise BenchError(f"{path}: {e}") from e
    # the model's default form where the log marks it (", default"), else the last timing of a
    # whole call (not a pass timed alone)
    found = [m for m in KDA_OURS.findall(text) if "alone" not in m[3]]
    ours = {m[:3]: float(m[4]) for m in found}
    ours.update({m[:3]: float(m[3]) for m in KDA_DEFAULT.findall(text)})
    bf16 = {m[:3]: float(m[4]) for m in found if m[3] == KDA_BF16_FORM}
    out = {}
    for T, H, D, dtype, ms in KDA_FLA.findall(text):
        if (T, H, D) in ours and dtype in ("bfloat16", "float32"):
            tag = "bf16" if dtype == "bfloat16" else "f32"
            out[f"kda_chunk_vs_fla_{tag}"] = (float(ms) / ours[(T, H, D)],
                                              f"T={T} H={H} D={D}: fla {ms} ms, "
                                              f"ours {ours[(T, H, D)]} ms")
        if (T, H, D) in bf16 and dtype == "bfloat16":  # issue 33's BF16 path against FLA's
            out["kda_chunk_vs_fla_bf16_bf16mode"] = (
                float(ms) / bf16[(T, H, D)],
                f"T={T} H={H} D={D}: fla bf16 {ms} ms, ours (bf16) {bf16[(T, H, D)]} ms")
    var = {(n, L, mode): float(ms) for n, L, mode, ms in KDA_VAR_OURS.findall(text)}
    for n, L, ms in KDA_VAR_FLA.findall(text):
        # (a log with both default forms: the later one, 3xbf16, is the model's)
        for mode, tag in (("3xtf32", ""), ("3xbf16", ""), ("bf16", "_bf16mode")):
            if (n, L, mode) in var:
                out[f"kda_chunk_varlen_{n}x{L}_vs_fla_bf16{tag}"] = (
                    float(ms) / var[(n, L, mode)],
                    f"{n} x {L} tokens: fla bf16 {ms} ms, ours ({mode}) {var[(n, L, mode)]} ms")
    if not out:
        raise BenchError(f"{path}: no pair of our and FLA's chunked KDA times on one shape")
    return out


def commit_of(root):
    """The packed binaries' commit on the GPU machine (pack_devbin.sh), else the checkout's."""
    packed = os.path.join(root, ".devbin", "COMMIT")
    if os.path.exists(packed):
        return open(packed).read().strip()
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latest", default=os.path.join(root, "bench", "latest.json"))
    ap.add_argument("--prefix", default="h200", help="machine key prefix (h200, cpu, ...)")
    ap.add_argument("--commit", default=None, help="default: .devbin/COMMIT, else git HEAD")
    ap.add_argument("--machine", default=None, help="words for the machine (default: prefix)")
    ap.add_argument("--date", default=None, help="default: today (UTC)")
    ap.add_argument("sources", nargs="+")
    a = ap.parse_args(argv)
    found = {}
    try:
        for s in a.sources:
            kind, _, rest = s.partition(":")
            if kind == "bench":
                found.update(from_bench(rest))
            elif kind == "serve":
                label, _, path = rest.partition(":")
                if not label or not path:
                    raise BenchError(f"{s}: expected serve:LABEL:FILE")
                found.update(from_serve(label, path))
            elif kind == "kda":
                found.update(from_kda(rest))
            else:
                raise BenchError(f"{s}: unknown source kind '{kind}' (bench, serve, kda)")
        latest = load_json(a.latest) if os.path.exists(a.latest) else {}
    except BenchError as e:
        print(f"bench_latest: {e}", file=sys.stderr)
        return 1
    if not found:
        print("bench_latest: the sources measure none of the headline figures", file=sys.stderr)
        return 1
    stamp = {"commit": a.commit or commit_of(root), "machine": a.machine or a.prefix,
             "date": a.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    for key, (value, detail) in found.items():
        v = round(value, 4) if isinstance(value, float) else value
        latest[f"{a.prefix}.{key}"] = {"value": v, **stamp, "source": detail}
        print(f"{a.prefix}.{key} = {v}  ({detail})")
    tmp = a.latest + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(sorted(latest.items())), f, indent=1)
        f.write("\n")
    os.replace(tmp, a.latest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
