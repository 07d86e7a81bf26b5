#!/usr/bin/env python3
"""Checks a tokenizer folder written by train_tokenizer.py against two independent encoders:
tiktoken (built from the file with the Kimi pattern, as Moonshot's tokenization_kimi.py does) and
the C engine (`deltaserve tokenize`). Asserts identical ids, exact decoding, one token per digit
and that every rank re-encodes to itself; prints the average token counts.

Usage: python3 tools/data/check_tokenizer.py DIR [--bin build-helperA/deltaserve] [--n 300]
"""
import argparse
import base64
import json
import os
import subprocess
import sys

import tiktoken

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gsm  # noqa: E402
from train_tokenizer import KIMI_PATTERN, N_SPECIAL  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))


def load_encoding(d):
    ranks = {}
    with open(os.path.join(d, "tiktoken.model"), "rb") as f:
        for line in f:
            if line.strip():
                b, r = line.split()
                ranks[base64.b64decode(b)] = int(r)
    n = len(ranks)
    assert sorted(ranks.values()) == list(range(n)), "ranks must be contiguous from 0"
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    assert all(n <= k < n + N_SPECIAL for k in named), "special ids must follow the ranks"
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + N_SPECIAL)}
    enc = tiktoken.Encoding(name="gsm", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens=specials)
    return enc, ranks, cfg


def c_encode(binary, d, text):
    out = subprocess.run([binary, "tokenize", "--model", d, "--text", text, "--no-allow-special"],
                         capture_output=True, text=True, check=True).stdout
    head = out.split("\n", 1)[0]  # "<n> tokens: 1,2,3"
    ids = head.split(": ", 1)[1]
    return [int(x) for x in ids.split(",")] if ids else []


def c_decode(binary, d, ids):
    out = subprocess.run([binary, "tokenize", "--model", d, "--decode", ",".join(map(str, ids))],
                         capture_output=True, check=True).stdout
    assert out.endswith(b"\n")
    return out[:-1].decode("utf-8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build-helperA", "deltaserve"))
    ap.add_argument("--n", type=int, default=300, help="examples to compare (plus n/6 prompts)")
    a = ap.parse_args(argv)
    enc, ranks, cfg = load_encoding(a.dir)
    n_ranks = len(ranks)

    # every rank must be what tiktoken's rule makes of its own bytes, and none may hold 2 digits
    for t, r in ranks.items():
        assert enc._encode_single_piece(t) == [r], f"rank {r} {t!r} is not derivable"
        assert len(t) == 1 or not any(48 <= b <= 57 for b in t), f"rank {r} {t!r} has a digit"

    shots = gsm.fewshot_examples()
    train = gsm.make_problems("train", a.n, 99)
    test = gsm.make_problems("test", gsm.TEST_SIZE, 0)
    examples = [gsm.format_example(p) for p in train + test[: a.n // 3]]
    prompts = [gsm.few_shot_prompt(p["question"], shots) for p in test[: max(1, a.n // 6)]]
    texts = examples + prompts + ["Hello, world! 12345 + 6789 = 19134.\n\n", "naïve café 你好"]

    use_c = os.path.exists(a.bin)
    if not use_c:
        print(f"warning: {a.bin} not found; comparing with tiktoken only", file=sys.stderr)
    for t in texts:
        ids = enc.encode_ordinary(t)
        assert enc.decode(ids) == t
        if use_c:
            cids = c_encode(a.bin, a.dir, t)
            assert cids == ids, f"C and tiktoken differ on {t!r}:\n{cids}\n{ids}"
            assert c_decode(a.bin, a.dir, ids) == t, f"C decode differs on {t!r}"
    # a digit string must come out as one token per digit
    digits = enc.encode_ordinary("0123456789 987")
    assert len(digits) == 10 + 1 + 3, digits

    ex_lens = [len(enc.encode_ordinary(t)) for t in examples]
    pr_lens = [len(enc.encode_ordinary(t)) for t in prompts]
    full = [len(enc.encode_ordinary(gsm.few_shot_prompt(p["question"], shots) + " " + p["solution"]
                                     + "\n#### " + str(p["answer"]))) for p in test]
    print(f"ok: {len(texts)} texts identical in tiktoken"
          + (" and the C engine" if use_c else "") + f"; n_ranks {n_ranks}, "
          f"vocab {n_ranks + N_SPECIAL}")
    print(f"tokens per example: mean {sum(ex_lens) / len(ex_lens):.1f}, max {max(ex_lens)}")
    print(f"tokens per 4-shot prompt: mean {sum(pr_lens) / len(pr_lens):.1f}, max {max(pr_lens)}")
    print(f"4-shot prompt + reference answer over the test set: mean "
          f"{sum(full) / len(full):.1f}, max {max(full)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
