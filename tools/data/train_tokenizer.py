#!/usr/bin/env python3
"""Learns a small byte-level BPE vocabulary on generator text and writes it as Kimi ships one:
`tiktoken.model` (base64 token bytes, space, rank; ranks 0..255 are the single bytes in byte order)
and `tokenizer_config.json` with the 256 K3 special tokens at ids n_ranks .. n_ranks + 255, laid
out like src/devtools/bpe_train.c writes them for the bundled models.

Rules:
  * text is pre-split with the Kimi pattern (docs/model.md §9.2), so merges never cross pieces;
  * no learned token contains a digit: numbers stay one token per digit, which keeps arithmetic
    learnable for a tiny model;
  * tiktoken encodes by "merge the adjacent pair whose concatenation has the lowest rank", not by
    replaying merges, so a candidate token is kept only if that rule, run on its own bytes, yields
    it (later tokens rank higher, so they never break an earlier token's derivation);
  * training stops when no allowed pair occurs at least twice or at --max-ranks, and the learned
    count is then cut down to a multiple of --multiple (default 64) so that n_ranks + 256 is a
    multiple of 64 too without padding the file (tiktoken files must have contiguous ranks).

Usage: python3 tools/data/train_tokenizer.py --out DIR [--n-examples 4000] [--seed 7]
"""
import argparse
import base64
import json
import os
import sys
from collections import Counter

import regex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gsm  # noqa: E402

# docs/model.md §9.2 in its original form; the `regex` module's V1 mode supports `&&`.
_NH_U = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NH_L = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _NH_U + "*" + _NH_L + "+" + _CONTR,
    r"[^\r\n\p{L}\p{N}]?" + _NH_U + "+" + _NH_L + "*" + _CONTR,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

N_SPECIAL = 256
# K3 special tokens: (offset from n_ranks, content, special flag); the same table as
# bpe_train.c's k_k3_specials (docs/model.md §9.3); the other slots are <|reserved_token_{id}|>.
K3_SPECIALS = [
    (0, "[BOS]", True), (1, "[EOS]", True), (2, "<|end_of_msg|>", True), (3, "<|open|>", True),
    (4, "<|close|>", True), (5, "<|sep|>", True), (6, "[start_header_id]", True),
    (7, "[end_header_id]", True), (9, "[EOT]", True), (18, "<|media_begin|>", True),
    (19, "<|media_content|>", True), (20, "<|media_end|>", True), (21, "<|media_pad|>", True),
    (254, "[UNK]", True), (255, "[PAD]", True),
]
# ids config.json needs, as offsets from n_ranks (init_model.c: SP_BOS, SP_EOS, SP_MEDIA, ...)
CONFIG_IDS = {"bos_token_id": 0, "eos_token_id": 2, "media_placeholder_token_id": 21,
              "mask_token_id (DSpark draft)": 253, "pad_token_id": 255}

_DIGITS = frozenset(b"0123456789")


def load_generator(path):
    """The data generator module: gsm.py by default, or another file (e.g. gsm2.py)."""
    if not path:
        return gsm
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm_gen", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def corpus_text(n_examples, seed, gen=gsm):
    """Generator text in the layout the model sees: examples joined by blank lines, plus the
    few-shot prompt of one test-style question so prompt-only strings are covered too.  A generator
    with chat items (gsm2.py) adds the text segments of its conversations (tag names, attributes,
    contents; the markers are special ids, never text)."""
    if hasattr(gen, "make_stream_items"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
        import chat_k3

        parts = []
        for it in gen.make_stream_items(n_examples, seed):
            if it[0] == "text":
                parts.append(it[1])
            else:
                for th, gp in ((it[2], False), (it[2], True)):
                    parts.append("\n".join(t for k, t in chat_k3.render_segments(it[1], th, gp) if k == "t"))
        probs = gen.make_problems("train", 1, seed)
        return "\n\n".join(parts) + "\n\n" + gen.few_shot_prompt(probs[0]["question"], gen.fewshot_examples())
    probs = gen.make_problems("train", n_examples, seed)
    text = "\n\n".join(gen.format_example(p) for p in probs)
    return text + "\n\n" + gen.few_shot_prompt(probs[0]["question"], gen.fewshot_examples())


def tiktoken_derives(tokens, rank_of, cand):
    """tiktoken's merge rule on cand's bytes with the vocabulary plus cand (ranked last):
    True if it ends as the single token cand. Leftmost lowest rank wins, as in tiktoken."""
    parts = [cand[i:i + 1] for i in range(len(cand))]
    last = len(tokens)
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            cat = parts[i] + parts[i + 1]
            r = last if cat == cand else rank_of.get(cat)
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            return False
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return True


def train(text, max_ranks, verbose=False):
    """Returns the token byte strings in rank order (the 256 bytes first)."""
    pat = regex.compile(KIMI_PATTERN, flags=regex.V1)
    pieces = Counter(m.encode("utf-8") for m in pat.findall(text))
    tokens = [bytes([b]) for b in range(256)]
    rank_of = {t: i for i, t in enumerate(tokens)}
    # each distinct piece as a list of token ids, with its count
    words = [([b for b in w], c) for w, c in pieces.items()]
    banned = set()
    while len(tokens) < max_ranks:
        counts = Counter()
        for sym, c in words:
            for i in range(len(sym) - 1):
                counts[(sym[i], sym[i + 1])] += c
        best = None
        for pair, c in counts.items():
            if c < 2 or pair in banned:
                continue
            # most frequent first; ties go to the smaller pair of ids, so runs are reproducible
            if best is None or c > best[0] or (c == best[0] and pair < best[1]):
                best = (c, pair)
        if best is None:
            break
        a, b = best[1]
        cat = tokens[a] + tokens[b]
        if _DIGITS.intersection(cat) and len(cat) > 1:
            banned.add((a, b))  # one token per digit: never merge anything with a digit
            continue
        ab = rank_of.get(cat)
        if ab is None:
            if not tiktoken_derives(tokens, rank_of, cat):
                banned.add((a, b))
                continue
            ab = len(tokens)
            tokens.append(cat)
            rank_of[cat] = ab
        # an existing token reached by another split is reused, not duplicated
        for k, (sym, c) in enumerate(words):
            if len(sym) < 2:
                continue
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    out.append(ab)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            words[k] = (out, c)
        if verbose and len(tokens) % 256 == 0:
            print(f"  {len(tokens)} tokens", file=sys.stderr)
    return tokens


def write_files(out_dir, tokens):
    os.makedirs(out_dir, exist_ok=True)
    n_ranks = len(tokens)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for r, t in enumerate(tokens):
            f.write(f"{base64.b64encode(t).decode()} {r}\n")
    dec = {}
    for off, name, special in K3_SPECIALS:
        dec[str(n_ranks + off)] = {"content": name, "lstrip": False, "normalized": False,
                                   "rstrip": False, "single_word": False, "special": special}
    cfg = {"added_tokens_decoder": dec, "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>",
           "pad_token": "[PAD]", "unk_token": "[UNK]", "chat_format": "k3",
           "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train the GSM byte-level BPE (Kimi tiktoken layout).")
    ap.add_argument("--out", required=True, help="folder for tiktoken.model and tokenizer_config")
    ap.add_argument("--n-examples", type=int, default=4000, help="train problems to learn from")
    ap.add_argument("--seed", type=int, default=7, help="train split seed for the corpus")
    ap.add_argument("--max-ranks", type=int, default=3840, help="cap on ordinary tokens")
    ap.add_argument("--multiple", type=int, default=64,
                    help="cut the learned count down to a multiple of this (1 = keep all)")
    ap.add_argument("--gsm", default=None, help="generator module (default tools/data/gsm.py)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    if not 256 < a.max_ranks <= 65536:
        ap.error("--max-ranks must be in 257..65536")
    tokens = train(corpus_text(a.n_examples, a.seed, load_generator(a.gsm)), a.max_ranks, a.verbose)
    learned = len(tokens)
    keep = max(256, learned - learned % max(1, a.multiple))
    tokens = tokens[:keep]  # dropping the last-ranked tokens never breaks an earlier derivation
    write_files(a.out, tokens)
    n = len(tokens)
    print(f"n_ranks {n} (learned {learned}, kept {n - 256} merges); vocab_size {n + N_SPECIAL}")
    print("config.json: vocab_size %d, " % (n + N_SPECIAL)
          + ", ".join(f"{k} {n + v}" for k, v in CONFIG_IDS.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
