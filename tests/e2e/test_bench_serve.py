"""`deltaserve bench serve` against the shared server (exact output lengths and the figures), and
`deltaserve bench` on the test model."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import DS_BIN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_serve(server, tmp_path):
    help_text = subprocess.run([DS_BIN, "bench", "serve", "--help"], capture_output=True,
                               text=True).stdout
    assert "--num-prompts" in help_text, "`deltaserve bench serve` is not dispatched"
    out = tmp_path / "bench.json"
    r = subprocess.run([DS_BIN, "bench", "serve", "--url", f"http://127.0.0.1:{server.port}",
                        "--num-prompts", "12", "--concurrency", "4", "--input-len", "20",
                        "--output-len", "9", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Serving Benchmark Result" in r.stdout and "P99 ITL (ms):" in r.stdout
    d = json.loads(out.read_text())
    assert d["completed"] == 12 and d["failed"] == 0
    assert d["output_lens"] == [9] * 12  # ignore_eos: exactly what was asked
    assert d["input_lens"] == [20] * 12
    assert d["total_output_tokens"] == 108
    assert 0 < d["median_ttft_ms"] <= d["p99_ttft_ms"]
    assert d["mean_e2el_ms"] > d["mean_ttft_ms"] > 0
    assert d["output_throughput"] > 0


def test_bench_serve_mixed_lengths(server, tmp_path):
    """--random-range-ratio: lengths drawn in [L (1 - R), L (1 + R)], not all equal, the same mix
    for the same seed; an out-of-range ratio is refused naming the flag."""
    def run(seed, ratio="0.5"):
        out = tmp_path / f"mixed{seed}.json"
        r = subprocess.run([DS_BIN, "bench", "serve", "--url", f"http://127.0.0.1:{server.port}",
                            "--num-prompts", "10", "--concurrency", "5", "--input-len", "20",
                            "--output-len", "8", "--random-range-ratio", ratio, "--seed",
                            str(seed), "--out", str(out)], capture_output=True, text=True,
                           timeout=120)
        return r, (json.loads(out.read_text()) if out.exists() else None)
    r, d = run(7)
    assert r.returncode == 0, r.stderr
    assert d["failed"] == 0
    assert all(10 <= n <= 30 for n in d["input_lens"]), d["input_lens"]
    assert all(4 <= n <= 12 for n in d["output_lens"]), d["output_lens"]
    assert len(set(d["input_lens"])) > 2 and len(set(d["output_lens"])) > 2
    assert d["total_output_tokens"] == sum(d["output_lens"])
    r2, d2 = run(7)
    assert sorted(d2["input_lens"]) == sorted(d["input_lens"])  # clients finish in any order
    assert sorted(d2["output_lens"]) == sorted(d["output_lens"])
    bad, _ = run(1, ratio="1.5")
    assert bad.returncode == 2 and "--random-range-ratio" in bad.stderr


def test_bench_serve_response_format(server, tmp_path):
    """--response-format: every request carries it (the server compiles the schema once and finds
    it in its cache for the rest), outputs stop at the grammar's end at the latest, and a value
    that is no JSON object is refused naming the flag."""
    import importlib.util
    if not importlib.util.find_spec("llguidance"):
        pytest.fail("llguidance is not installed (make deps installs it)")
    tag = "k" + os.urandom(6).hex()  # a schema no other test sent: a compile of its own
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": {
        "type": "object", "properties": {tag: {"type": "string", "maxLength": 40}},
        "required": [tag], "additionalProperties": False}}}
    m0 = server.metrics()
    out = tmp_path / "rf.json"
    r = subprocess.run([DS_BIN, "bench", "serve", "--url", f"http://127.0.0.1:{server.port}",
                        "--num-prompts", "6", "--concurrency", "3", "--input-len", "12",
                        "--output-len", "30", "--response-format", json.dumps(rf), "--out",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m1 = server.metrics()
    d = json.loads(out.read_text())
    assert d["completed"] == 6 and d["failed"] == 0 and d["response_format"] == rf
    assert all(1 <= n <= 30 for n in d["output_lens"]), d["output_lens"]

    def delta(name):
        return m1.get("deltaserve:" + name, 0) - m0.get("deltaserve:" + name, 0)
    assert delta("grammar_compiles_total") == 1
    assert delta("grammar_cache_hits_total") >= 5  # the other five requests' checks at least
    # the masks' time and the matchers' (each constrained row made one mask, took one token)
    assert delta("grammar_mask_seconds_total") > 0 and delta("grammar_accept_seconds_total") > 0
    if "--test-async-masks 1" not in os.environ.get("DS_SERVE_ARGS", ""):
        # made before the forward: each step waited for all of its masks' time
        assert delta("grammar_mask_wait_seconds_total") == pytest.approx(
            delta("grammar_mask_seconds_total"), rel=1e-6)
    # --output-lens-from: a plain run of exactly the constrained run's lengths (its own
    # --output-len, 50, is what each request would get if the flag did nothing)
    out2 = tmp_path / "plain.json"
    r = subprocess.run([DS_BIN, "bench", "serve", "--url", f"http://127.0.0.1:{server.port}",
                        "--num-prompts", "6", "--concurrency", "3", "--input-len", "12",
                        "--output-len", "50", "--output-lens-from", str(out), "--out", str(out2)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(out2.read_text())["output_lens"] == d["output_lens"]
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"output_lens": [3, 4]}))
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"output_lens": [3, 0, 1, 1, 1, 1]}))
    for bad, what in ((short, "an array of 6"), (zero, "output_lens[1]"),
                      (tmp_path / "none.json", "none.json")):
        b = subprocess.run([DS_BIN, "bench", "serve", "--url", f"http://127.0.0.1:{server.port}",
                            "--num-prompts", "6", "--output-lens-from", str(bad)],
                           capture_output=True, text=True, timeout=60)
        assert b.returncode == 2 and "--output-lens-from" in b.stderr and what in b.stderr, \
            (bad, b.stderr)
    for bad in ("[1, 2]", "{not json", "@/nonexistent/rf.json"):
        b = subprocess.run([DS_BIN, "bench", "serve", "--url", f"http://127.0.0.1:{server.port}",
                            "--num-prompts", "1", "--response-format", bad],
                           capture_output=True, text=True, timeout=60)
        assert b.returncode == 2 and "--response-format" in b.stderr, (bad, b.stderr)


@pytest.mark.once  # no server: DS_SERVE_ARGS changes nothing
@pytest.mark.parametrize("full_logits", [False, True])
def test_model_bench(tmp_path, full_logits):
    """`deltaserve bench` on the test model: its decode steps end with greedy tokens picked beside
    the logits, or with every row's logits (--full-logits), whose host sampling it then times."""
    from conftest import DS_MODEL
    out = tmp_path / "model_bench.json"
    r = subprocess.run([DS_BIN, "bench", "--model", DS_MODEL, "--prompt-tokens", "8", "--reps", "1",
                        "--decode-steps", "2", "--decode-context", "4", "--batch-sizes", "1,3",
                        "--json", str(out)] + (["--full-logits"] if full_logits else []),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert [x["batch"] for x in d["decode"]] == [1, 3]
    assert d["decode_context"] == 4 and d["decode_steps"] == 2
    # tools/bench_latest.py reads this very output: batch 1's fraction of the read rate
    latest = tmp_path / "latest.json"
    b = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_latest.py"), "--latest",
                        str(latest), "--prefix", "cpu", f"bench:{out}"], capture_output=True,
                       text=True, timeout=60)
    assert b.returncode == 0, b.stderr
    got = json.loads(latest.read_text())["cpu.decode_b1_read_fraction"]
    assert got["value"] == round(d["decode"][0]["frac_bw"], 4) and got["value"] > 0
    assert all(x["tps"] > 0 and x["ms_per_step"] > 0 for x in d["decode"])
    sampling = [l for l in r.stdout.splitlines() if l.startswith("host sampling batch")]
    if full_logits:  # one line a batch size, with its two positive timings
        assert [l.split()[3] for l in sampling] == ["1", "3"], r.stdout
        for l in sampling:
            m = re.search(r": ([\d.]+) ms on 1 thread, ([\d.]+) ms on (\d+)$", l)
            assert m and float(m[1]) > 0 and float(m[2]) > 0 and int(m[3]) >= 1, l
    else:
        assert not sampling, r.stdout


@pytest.mark.once  # no server
def test_bench_latest_kda_ratio_is_the_default_forms(tmp_path):
    """tools/bench_latest.py's KDA figure is FLA's time over our model's default form (the line
    test_cuda_kernels marks ", default"), not over whichever form the log times last; a log
    without the mark falls back to the last (older logs)."""
    ours = ["bench kda chunked prefill T=8192 H=32 dk=dv=128: 2.900 ms, 2825233 tokens/s",
            "bench kda chunked prefill T=8192 H=32 dk=dv=128 (tf32 scan and outputs, pass 1 f32): "
            "1.700 ms, 4818823 tokens/s",
            "bench kda chunked prefill T=8192 H=32 dk=dv=128 (3xtf32 scan and outputs, pass 1 f32, "
            "default): 2.000 ms, 4096000 tokens/s",
            "bench kda chunked prefill T=8192 H=32 dk=dv=128 (3xtf32 scan and outputs, pass 1 "
            "tensor cores): 2.500 ms, 3276800 tokens/s"]
    fla = ["fla chunk_kda T=8192 H=32 dk=dv=128 float32: 2.100 ms, 3.90 M tokens/s",
           "fla chunk_kda T=8192 H=32 dk=dv=128 bfloat16: 1.000 ms, 8.19 M tokens/s"]

    def ratios(lines):
        log, latest = tmp_path / "kda.log", tmp_path / "latest.json"
        log.write_text("\n".join(lines) + "\n")
        latest.unlink(missing_ok=True)
        b = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_latest.py"),
                            "--latest", str(latest), "--prefix", "h100", f"kda:{log}"],
                           capture_output=True, text=True, timeout=60)
        assert b.returncode == 0, b.stderr
        got = json.loads(latest.read_text())
        return got["h100.kda_chunk_vs_fla_f32"]["value"], got["h100.kda_chunk_vs_fla_bf16"]["value"]

    assert ratios(ours + fla) == (round(2.1 / 2.0, 4), round(1.0 / 2.0, 4))
    unmarked = [l.replace(", default", "") for l in ours]
    assert ratios(unmarked + fla) == (round(2.1 / 2.5, 4), round(1.0 / 2.5, 4))


@pytest.mark.once
def test_model_bench_chunked(tmp_path):
    """--prefill-chunk: the prompt and every decode context run in forwards of at most N tokens
    (as long contexts must); the greedy tokens of the decode steps that follow are those of the
    whole-prompt forward, and a negative size is refused naming the flag."""
    from conftest import DS_MODEL

    def run(chunk):
        out = tmp_path / f"chunk{chunk}.json"
        r = subprocess.run([DS_BIN, "bench", "--model", DS_MODEL, "--prompt-tokens", "40",
                            "--reps", "1", "--decode-steps", "4", "--decode-context", "40",
                            "--batch-sizes", "1,3", "--prefill-chunk", str(chunk), "--json",
                            str(out)], capture_output=True, text=True, timeout=300)
        return r, (json.loads(out.read_text()) if r.returncode == 0 else None)
    _, whole = run(0)
    r, chunked = run(7)
    assert r.returncode == 0, r.stderr
    assert chunked["prefill_chunk"] == 7 and chunked["prompt_tps"] > 0
    assert [x["ids_hash"] for x in chunked["decode"]] == [x["ids_hash"] for x in whole["decode"]]
    bad, _ = run(-1)
    assert bad.returncode != 0 and "--prefill-chunk" in bad.stderr


@pytest.mark.once
def test_timeline_step_attributes_overlap_and_gaps(tmp_path):
    # tools/timeline_step.py on a timeline made here: two steps (cut at the embedding kernel) of
    # an embedding, A and B overlapping by 10 us, 10 us with nothing running, then C; the next
    # step 40 us after C ends. Each figure below is what that layout gives and nothing else.
    def step(t0):
        us = 1000
        return [(t0, 10 * us, "7", "_Z7embed_kPfPKiii"),
                (t0 + 10 * us, 20 * us, "8", "_Z11gemv_bf16_kILi1EEvPf"),  # A: 10-30
                (t0 + 20 * us, 20 * us, "9", "_Z11moe_route_kPiPf"),       # B: 20-40
                (t0 + 50 * us, 10 * us, "8", "sm90_xmma_gemm_bf16")]       # C: 50-60
    rows = step(0) + step(100000) + step(200000)
    csv_path = tmp_path / "tl.csv"
    csv_path.write_text("start_ns,dur_ns,stream,name\n" +
                        "".join(f"{s},{d},{st},{n}\n" for s, d, st, n in rows))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "timeline_step.py"),
                        str(csv_path), "--steps", "2", "--show", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[0]
    assert "steps: 2; kernels a step 4; span 60.0 us (idle inside 10.0 us)" in head, head
    assert "next step's first kernel 40.0 us; step to step 100.0 us" in head, head
    got = {}
    for line in r.stdout.splitlines()[2:]:
        f = line.split()
        if len(f) == 6 and f[-1].endswith("%"):
            got[f[0]] = [float(x) for x in f[1:5]]  # count, own, alone, shared (us a step)
    assert got["gemv_bf16_k"] == [1.0, 20.0, 10.0, 5.0]
    assert got["moe_route_k"] == [1.0, 20.0, 10.0, 5.0]
    assert got["embed_k"] == [1.0, 10.0, 10.0, 0.0]
    assert got["sm90_xmma_gemm_bf16"] == [1.0, 10.0, 10.0, 0.0]
