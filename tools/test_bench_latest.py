"""tools/bench_latest.py: which keys a source measures, their values and stamps, and the refusals
(a source of the wrong kind, a serving run with failures). The real `deltaserve bench` output is
checked against it in tests/e2e/test_bench_serve.py."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_latest  # noqa: E402

BENCH = {"model": "configs/kimi-linear-48b-a3b", "device": "NVIDIA H200", "quantization": "none",
         "kv_cache_dtype": "auto", "cuda_graphs": 1, "prompt_tokens": 8192, "prompt_tps": 40000.0,
         "prompt_gemm_frac_peak": 0.41, "decode_context": 512, "decode_steps": 8,
         "decode": [{"batch": 1, "tps": 400.0, "ms_per_step": 2.5, "gbs": 2900.0,
                     "frac_bw": 0.6123},
                    {"batch": 256, "tps": 7000.0, "ms_per_step": 36.0, "gbs": 0, "frac_bw": 0}]}


def run(tmp_path, *sources, prefix="h200"):
    latest = tmp_path / "latest.json"
    rc = bench_latest.main(["--latest", str(latest), "--prefix", prefix, "--commit", "abc1234",
                            "--date", "2026-12-04", *sources])
    return rc, (json.loads(latest.read_text()) if latest.exists() else None)


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def test_bench_keys(tmp_path):
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "b.json", BENCH))
    assert rc == 0
    assert d["h200.decode_b1_copy_fraction"]["value"] == 0.6123
    assert d["h200.decode_b1_copy_ms"]["value"] == 2.5
    assert d["h200.prefill_8192_gemm_fraction"]["value"] == 0.41
    assert d["h200.decode_b1_copy_fraction"]["commit"] == "abc1234"
    assert d["h200.decode_b1_copy_fraction"]["date"] == "2026-12-04"
    assert not any("256" in k for k in d)  # only batch 1 is a headline
    assert "h200.prefill_8192_whole_fraction" not in d  # the bench's JSON has no frac_peak here
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "w.json", dict(BENCH, prompt_frac_peak=0.32)))
    assert d["h200.prefill_8192_whole_fraction"]["value"] == 0.32
    assert "h200.prefill_8192_peak_fraction" not in d  # (the CPU's key)


def test_quant_long_context_and_merge(tmp_path):
    run(tmp_path, "bench:" + write(tmp_path, "b.json", BENCH))
    q = dict(BENCH, quantization="ptpc_fp8", decode_context=1048576, kv_cache_dtype="fp8",
             prompt_tokens=131072, prompt_tps=8192.0)
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "q.json", q))
    assert rc == 0
    assert d["h200.decode_1m_context_ptpc_fp8_copy_fraction_kvfp8"]["value"] == 0.6123
    assert d["h200.ttft_128k_s_kvfp8"]["value"] == 16.0
    assert "h200.decode_b1_copy_fraction" in d  # the earlier run's keys stay
    assert not any(k.startswith("h200.prefill_131072") for k in d)  # quantized: not the GEMM figure
    # a quantized headline run (short context) has its own prompt figure beside BF16's
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "qh.json",
                                           dict(BENCH, quantization="ptpc_fp8",
                                                prompt_frac_peak=0.34)))
    assert rc == 0 and d["h200.prefill_8192_ptpc_fp8_whole_fraction"]["value"] == 0.34
    assert "h200.prefill_8192_whole_fraction" not in d  # (BF16's, from no run here yet)
    assert d["h200.decode_b1_ptpc_fp8_copy_fraction"]["value"] == 0.6123
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "qs.json",
                                           dict(BENCH, quantization="ptpc_fp8", prompt_tokens=512,
                                                prompt_frac_peak=0.02)))
    assert rc == 0 and not any(k.startswith("h200.prefill_512") for k in d)  # a decode's set-up
    # a long-context decode run's prompt (its set-up, timed once) leaves the prompt figures alone
    run(tmp_path, "bench:" + write(tmp_path, "w.json", dict(BENCH, prompt_frac_peak=0.32)))
    long = dict(BENCH, decode_context=1048576, kv_cache_dtype="bf16", prompt_frac_peak=0.12,
                prompt_gemm_frac_peak=0.2)
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "l.json", long))
    assert rc == 0 and d["h200.decode_1m_context_copy_fraction_kvbf16"]["value"] == 0.6123
    assert d["h200.prefill_8192_whole_fraction"]["value"] == 0.32
    assert d["h200.prefill_8192_gemm_fraction"]["value"] == 0.41


def test_cpu_and_eager(tmp_path):
    cpu = dict(BENCH, device="cpu (avx2)", cuda_graphs=0)
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "c.json", cpu), prefix="cpu")
    assert rc == 0 and d["cpu.decode_b1_read_fraction"]["value"] == 0.6123
    assert "cpu.prefill_8192_peak_fraction" not in d  # the bench's JSON has no frac_peak here
    rc, d = run(tmp_path, "bench:" + write(tmp_path, "c2.json", dict(cpu, prompt_frac_peak=0.3)),
                prefix="cpu")
    assert d["cpu.prefill_8192_peak_fraction"]["value"] == 0.3
    eager = dict(BENCH, cuda_graphs=0, prompt_gemm_frac_peak=0)
    sub = tmp_path / "eager"
    sub.mkdir()
    rc, d = run(sub, "bench:" + write(tmp_path, "e.json", eager))
    assert rc == 1 and d is None  # eager GPU steps measure no headline figure


def test_serve_and_kda(tmp_path):
    serve = {"completed": 64, "failed": 0, "output_throughput": 1234.5, "median_ttft_ms": 20.0,
             "p99_ttft_ms": 80.0, "median_itl_ms": 5.0, "p99_itl_ms": 9.0}
    log = ("bench kda chunked prefill T=8192 H=32 dk=dv=128: 0.800 ms, 10240000 tokens/s\n"
           "fla chunk_kda T=8192 H=32 dk=dv=128 bfloat16: 1.000 ms, rel error 1e-3\n")
    rc, d = run(tmp_path, "serve:c16:" + write(tmp_path, "s.json", serve),
                "kda:" + write(tmp_path, "k.log", log))
    assert rc == 0
    assert d["h200.serve.c16"]["value"]["output_throughput"] == 1234.5
    assert d["h200.serve.c16"]["value"]["p99_itl_ms"] == 9.0
    assert d["h200.kda_chunk_vs_fla_bf16"]["value"] == 1.25


def test_kda_bf16_mode_and_passes_alone(tmp_path):
    log = ("bench kda chunked prefill T=8192 H=32 dk=dv=128 (bf16 scan and outputs, pass 1 f32): "
           "1.250 ms, 6553600 tokens/s\n"
           "bench kda chunked prefill T=8192 H=32 dk=dv=128 (3xtf32 scan and outputs, pass 1 f32, "
           "default): 2.000 ms, 4096000 tokens/s\n"
           "bench kda chunked prefill T=8192 H=32 dk=dv=128 (bf16 scan and outputs, pass 1 f32), "
           "pass 1 alone: 0.800 ms\n"
           "fla chunk_kda T=8192 H=32 dk=dv=128 bfloat16: 1.000 ms, rel error 1e-3\n")
    rc, d = run(tmp_path, "kda:" + write(tmp_path, "k.log", log))
    assert rc == 0
    assert d["h200.kda_chunk_vs_fla_bf16"]["value"] == 0.5  # the default form, not a pass alone
    assert d["h200.kda_chunk_vs_fla_bf16_bf16mode"]["value"] == 0.8
    # without a default line the last whole call counts, never a pass timed alone
    sub = tmp_path / "nodefault"
    sub.mkdir()
    rc, d = run(sub, "kda:" + write(tmp_path, "k2.log", log.replace(", default", "")))
    assert d["h200.kda_chunk_vs_fla_bf16"]["value"] == 0.5


def test_kda_varlen(tmp_path):
    log = ("bench kda chunked prefill T=8192 H=32 dk=dv=128 (3xtf32 scan and outputs, pass 1 f32, "
           "default): 2.000 ms, 4096000 tokens/s\n"
           "bench kda chunked varlen 8 x 1024 H=32 dk=dv=128 (3xtf32 scan and outputs, pass 1 f32): "
           "2.000 ms, 4096000 tokens/s\n"
           "bench kda chunked varlen 8 x 1024 H=32 dk=dv=128 (bf16 scan and outputs, pass 1 f32): "
           "1.250 ms, 6553600 tokens/s\n"
           "fla chunk_kda T=8192 H=32 dk=dv=128 bfloat16: 1.000 ms, 8.19 M tokens/s\n"
           "fla chunk_kda varlen 8 x 1024 H=32 dk=dv=128 bfloat16: 1.500 ms, 5.46 M tokens/s\n")
    rc, d = run(tmp_path, "kda:" + write(tmp_path, "k.log", log))
    assert rc == 0
    assert d["h200.kda_chunk_vs_fla_bf16"]["value"] == 0.5
    assert d["h200.kda_chunk_varlen_8x1024_vs_fla_bf16"]["value"] == 0.75
    assert d["h200.kda_chunk_varlen_8x1024_vs_fla_bf16_bf16mode"]["value"] == 1.2
    assert "32x256" not in " ".join(d)
    # the default since session 47, 3xBF16: its varlen line is the default key's
    sub = tmp_path / "x3bf16"
    sub.mkdir()
    log2 = log.replace("3xtf32 scan", "3xbf16 scan").replace("varlen 8 x 1024 H=32 dk=dv=128 "
                                                             "(3xbf16 scan and outputs, pass 1 f32): "
                                                             "2.000", "varlen 8 x 1024 H=32 "
                                                             "dk=dv=128 (3xbf16 scan and outputs, "
                                                             "pass 1 f32): 1.875")
    rc, d = run(sub, "kda:" + write(tmp_path, "k3.log", log2))
    assert rc == 0
    assert d["h200.kda_chunk_varlen_8x1024_vs_fla_bf16"]["value"] == 0.8


@pytest.mark.parametrize("source,why", [
    ("bench:{d}/nope.json", "No such file"),
    ("serve:c1:{serve_failed}", "requests failed"),
    ("bench:{serve_failed}", "not a bench result"),
    ("kda:{empty}", "no pair"),
    ("perf:{empty}", "unknown source kind"),
])
def test_refusals(tmp_path, capsys, source, why):
    paths = {"d": str(tmp_path), "empty": write(tmp_path, "e.log", "nothing\n"),
             "serve_failed": write(tmp_path, "f.json", {"completed": 3, "failed": 1,
                                                         "output_throughput": 1.0,
                                                         "median_ttft_ms": 1, "p99_ttft_ms": 2})}
    rc, d = run(tmp_path, source.format(**paths))
    assert rc == 1 and d is None
    assert why in capsys.readouterr().err
