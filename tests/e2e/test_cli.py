"""The command line's generate: the ids `--print-ids` lists are the tokens it generated. Greedy
tokens are the argmax of the teacher-forced logits (`deltaserve logits`) over the prompt and the
tokens before them, and their text is the one printed above the ids. The statistics go to stderr;
flag errors name the flag; test-only flags work but --help does not list them."""

import subprocess

import pytest

import numpy as np

from conftest import DS_BIN, DS_MODEL

pytestmark = pytest.mark.once  # its own servers: DS_SERVE_ARGS changes nothing


def run(*args):
    """stdout as bytes: a token's bytes need not be whole UTF-8 characters"""
    r = subprocess.run([DS_BIN, *args], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout


def test_generate_print_ids_are_the_greedy_tokens(tmp_path):
    prompt = "Question: Tom has 3 apples and buys 5 more. How many"
    n = 8
    out = run("generate", "--model", DS_MODEL, "--prompt", prompt, "-n", str(n), "--ignore-eos",
              "--print-ids", "--temperature", "0")
    text, ids_line = out.rstrip(b"\n").rsplit(b"\n", 1)
    assert ids_line.startswith(b"ids: "), out
    ids = [int(x) for x in ids_line[len(b"ids: "):].split(b",")]
    assert len(ids) == n
    # the prompt's ids as generate encodes them (no special tokens in it)
    p_ids = [int(x) for x in run("tokenize", "--model", DS_MODEL, "--text", prompt)
             .split(b"\n")[0].split(b": ")[1].split(b",")]
    npy = tmp_path / "logits.npy"
    run("logits", "--model", DS_MODEL, "--token-ids", ",".join(map(str, p_ids + ids[:-1])),
        "--out", str(npy))
    logits = np.load(npy)
    assert logits.shape[0] == len(p_ids) + n - 1
    assert ids == logits[len(p_ids) - 1:].argmax(-1).tolist()
    # the text is those tokens' (special ones print nothing), as the engine streams text: valid
    # UTF-8, bytes that cannot be UTF-8 replaced the way Python's errors="replace" does
    decoded = run("tokenize", "--model", DS_MODEL, "--decode", ",".join(map(str, ids)),
                  "--skip-special")
    assert text == decoded.rstrip(b"\n").decode("utf-8", errors="replace").encode()


def test_generate_stats_on_stderr_and_stop():
    r = subprocess.run([DS_BIN, "generate", "--model", DS_MODEL, "--prompt", "Question: Tom has",
                        "-n", "4", "--ignore-eos", "-t", "0"], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert b"tok/s" not in r.stdout
    stats = [l for l in r.stderr.split(b"\n") if l.startswith(b"[deltaserve] prompt ")]
    assert len(stats) == 1 and b"decode 3 tokens" in stats[0], r.stderr


def test_flag_errors_name_the_flag():
    for cmd, args, names in [
            ("generate", ["--prompt", "x", "--num-speculative-tokens", "3"],
             [b"--num-speculative-tokens", b"--speculative-method"]),
            ("serve", ["--num-speculative-tokens", "3"],
             [b"--num-speculative-tokens", b"--speculative-method"]),
            ("generate", ["--prompt", "x", "--top-p", "2"], [b"--top-p"]),
            ("generate", ["--prompt", "x", "--max-tokens", "0"], [b"--max-tokens"])]:
        r = subprocess.run([DS_BIN, cmd, "--model", DS_MODEL, *args], capture_output=True,
                           timeout=60)
        assert r.returncode == 2, (cmd, args, r.stderr)
        for name in names:
            assert name in r.stderr, (cmd, args, r.stderr)


def test_max_model_len_beyond_the_model_or_cache_is_an_error():
    """--max-model-len above the model's positions or above what the kv cache holds stops with a
    message naming the flag and the limit (as vLLM does), not a silent cut to the limit."""
    for args, words in [(["--max-model-len", "99999"], [b"--max-model-len 99999",
                                                        b"max_position_embeddings 4096"]),
                        (["--max-model-len", "4000", "--kv-cache-memory", "2M"],
                         [b"--max-model-len 4000", b"tokens the kv cache holds"])]:
        r = subprocess.run([DS_BIN, "generate", "--model", DS_MODEL, "--prompt", "x", "-n", "2",
                            *args], capture_output=True, timeout=60)
        assert r.returncode != 0 and b"Traceback" not in r.stderr, (args, r.stderr)
        for w in words:
            assert w in r.stderr, (args, r.stderr)
    r = subprocess.run([DS_BIN, "generate", "--model", DS_MODEL, "--prompt", "x", "-n", "2",
                        "--max-model-len", "4096"], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr  # the model's own limit is allowed


def test_test_hooks_hidden_from_help():
    for cmd in ["serve", "generate"]:
        out = run(cmd, "--help")
        assert b"--speculative-test-oracle" not in out and b"--prefix-hash-bits" not in out
        assert b"--num-speculative-tokens" in out
