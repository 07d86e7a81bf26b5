"""The command line's generate: the ids `--print-ids` lists are the tokens it generated. Greedy
tokens are the argmax of the teacher-forced logits (`deltaserve logits`) over the prompt and the
tokens before them, and their text is the one printed above the ids."""

import subprocess

import numpy as np

from conftest import DS_BIN, DS_MODEL


def run(*args):
    """stdout as bytes: a token's bytes need not be whole UTF-8 characters"""
    r = subprocess.run([DS_BIN, *args], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout


def test_generate_print_ids_are_the_greedy_tokens(tmp_path):
    prompt = "Question: Tom has 3 apples and buys 5 more. How many"
    n = 8
    out = run("generate", "--model", DS_MODEL, "--prompt", prompt, "-n", str(n), "--ignore-eos",
              "--print-ids")
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
    # the text is those tokens' (special ones print nothing)
    decoded = run("tokenize", "--model", DS_MODEL, "--decode", ",".join(map(str, ids)),
                  "--skip-special")
    assert text == decoded.rstrip(b"\n")
