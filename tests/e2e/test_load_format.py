"""`init-model --shape-of` and `serve --load-format dummy`: a model's shape served with drawn
weights (how the 48B-shape serving benchmarks run without 96 GB of files)."""
import json
import os
import subprocess

import pytest

from conftest import DS_BIN, DS_MODEL, Server

pytestmark = pytest.mark.once  # its own servers: DS_SERVE_ARGS changes nothing


def shape_of(tmp_path):
    out = tmp_path / "shape"
    r = subprocess.run([DS_BIN, "init-model", "--shape-of", DS_MODEL, "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_shape_folder(tmp_path):
    out = shape_of(tmp_path)
    assert sorted(os.listdir(out)) == ["config.json", "tiktoken.model", "tokenizer_config.json"]
    src = open(os.path.join(DS_MODEL, "config.json"), "rb").read()
    assert (out / "config.json").read_bytes() == src  # the shape as published, byte for byte
    cfg = json.loads(src)
    tok = json.loads((out / "tokenizer_config.json").read_text())
    # the specials where the config says they are: bos at the first special id
    specials = {int(k): v["content"] for k, v in tok["added_tokens_decoder"].items()}
    bos = cfg.get("bos_token_id", cfg.get("text_config", {}).get("bos_token_id"))
    assert min(specials) == bos and specials[bos] == tok["bos_token"]
    ranks = sum(1 for _ in open(out / "tiktoken.model"))
    assert ranks == bos


def test_serve_dummy(tmp_path):
    out = shape_of(tmp_path)
    srv = Server("--load-format", "dummy", env_args=False, model=str(out))
    try:
        st, body = srv.post_json("/v1/completions", {"model": "shape", "prompt": [5, 6, 7, 8],
                                                     "max_tokens": 6, "ignore_eos": True,
                                                     "temperature": 0})
        assert st == 200, body
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
        st, t = srv.post_json("/tokenize", {"prompt": "Mia has 23 apples."})
        assert st == 200 and t["tokens"]
        st, d = srv.post_json("/detokenize", {"tokens": t["tokens"]})
        assert st == 200 and d["prompt"] == "Mia has 23 apples."
    finally:
        assert srv.stop() == 0


def test_shape_needs_dummy(tmp_path):
    """Without --load-format dummy the weights are looked for, and their absence is named."""
    out = shape_of(tmp_path)
    r = subprocess.run([DS_BIN, "serve", "--model", str(out), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "safetensors" in (r.stderr + r.stdout)
    r = subprocess.run([DS_BIN, "serve", "--model", str(out), "--load-format", "npz"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--load-format" in r.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads(open(os.path.join(DS_MODEL, "config.json")).read())
    cfg["eos_token_id"] = 7
    (bad / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([DS_BIN, "init-model", "--shape-of", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "eos_token_id 7" in r.stderr
