"""`deltaserve bench serve` against the shared server: exact output lengths and the figures."""

import json
import subprocess

import pytest

from conftest import DS_BIN


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
