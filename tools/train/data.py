"""Training data for tools/train: synthetic GSM8K-style problems from tools/data/gsm.py
(`make_problems(split, n, seed)`, `format_example(p)`, examples joined by "\\n\\n"; or tools/data/gsm2.py's
`make_stream_items`, plain examples and K3 chat conversations), tokenized with the
Kimi tiktoken folder and packed into fixed-length sequences that start at an example boundary.
Generation and tokenization run in DataLoader worker processes."""
from __future__ import annotations

import importlib.util
import os
import re

try:
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
except ImportError:  # the mix parser and the generators need no torch (make test has none)
    torch = None
    IterableDataset = object

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GSM = os.path.join(HERE, "..", "data", "gsm.py")
SEP = "\n\n"
EVAL_SEED = 987_654_321  # held-out train-split problems for the quick accuracy estimate


def parse_mix(spec: str = None):
    """A data spec -> [(generator path, weight)], weights summing to 1.  The spec is one path
    (tools/data/gsm2.py) or a mix "PATH:W,PATH:W,..." (a missing weight counts as 1); the first
    generator is the main one (its few-shot format and held-out draw are what eval_prompts uses)."""
    spec = spec or DEFAULT_GSM
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        path, w = part, 1.0
        if ":" in part:
            path, ws = part.rsplit(":", 1)
            try:
                w = float(ws)
            except ValueError:
                raise ValueError(f"data mix {spec!r}: weight {ws!r} of {path!r} is not a number") from None
        if w <= 0:
            raise ValueError(f"data mix {spec!r}: weight of {path!r} must be > 0")
        if not os.path.isfile(path):
            raise ValueError(f"data mix {spec!r}: no generator file {path!r}")
        out.append((path, w))
    if not out:
        raise ValueError(f"data mix {spec!r} names no generator")
    tot = sum(w for _, w in out)
    return [(p, w / tot) for p, w in out]


def load_gsm(path: str = None):
    """The main generator module of a data spec (a path or a parse_mix mix: its first entry)."""
    return _load_one(parse_mix(path)[0][0])


class PackedStream(IterableDataset):
    """Endless batches [batch, seq_len + 1] of token ids (inputs = [:, :-1], labels = [:, 1:]).
    Each row starts at an example boundary; examples follow each other joined by "\\n\\n" and the
    example cut by the row end is dropped (the next row starts with a fresh example).  No BOS."""

    def __init__(self, tok_dir, seq_len, batch, seed, gsm_path=None, chunk=512):
        self.tok_dir, self.seq_len, self.batch, self.seed = tok_dir, seq_len, batch, seed
        self.gsm_path, self.chunk = gsm_path, chunk

    def __iter__(self):
        from tok import Tokenizer

        wi = get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi else (0, 1)
        tok = Tokenizer(self.tok_dir)
        mix = [(_load_one(p), w) for p, w in parse_mix(self.gsm_path)]
        n = self.seq_len + 1
        rows, cur, k = [], [], 0
        while True:
            # distinct seed per (run seed, worker, call); EVAL_SEED is far outside this range
            s = (self.seed * 1_000_003 + wid + nw * k) % 900_000_000
            k += 1
            for ids in mixed_ids(mix, tok, self.chunk, s):
                cur.extend(ids)
                if len(cur) >= n:
                    rows.append(cur[:n])
                    cur = []
                    if len(rows) == self.batch:
                        yield torch.tensor(rows, dtype=torch.long)
                        rows = []


def _load_one(path):
    """One generator module from its file (a module name of its own per path, so that a mix's
    generators stay apart), checked for what the training stream calls."""
    spec = importlib.util.spec_from_file_location("gsm_data_" + re.sub(r"\W", "_", os.path.abspath(path)), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for fn in ("make_problems", "format_example"):
        if not hasattr(mod, fn):
            raise AttributeError(f"{path} has no {fn}()")
    return mod


def mixed_ids(mix, tok, n, seed):
    """About n examples from the generators of `mix` [(module, weight)], each generator's share
    its weight (rounded, at least one example when its weight is > 0), interleaved in a random order
    fixed by the seed so that a row of the packed stream holds examples of several generators."""
    import random

    if len(mix) == 1:
        return example_ids(mix[0][0], tok, n, seed)
    out = []
    for i, (gsm, w) in enumerate(mix):
        # each generator gets its own seed range, so two generators never share a draw
        out.extend(example_ids(gsm, tok, max(1, round(n * w)), seed + 1_000_000_000 * i))
    random.Random(f"mix:{seed}").shuffle(out)
    return out


def example_ids(gsm, tok, n, seed):
    """Token ids of n training examples of generator `gsm`, each a list.  A generator with
    make_stream_items (tools/data/gsm2.py) gives plain examples (followed by SEP) and chat
    conversations, rendered exactly as the server renders a chat (chat_k3.py) and ending in
    <|end_of_msg|>; otherwise every example is format_example(p) + SEP."""
    if not hasattr(gsm, "make_stream_items"):
        texts = [gsm.format_example(p) + SEP for p in gsm.make_problems("train", n, seed)]
        return tok.encode_batch(texts)
    import chat_k3

    items = gsm.make_stream_items(n, seed)
    texts = tok.encode_batch([it[1] + SEP for it in items if it[0] == "text"])
    out, k = [], 0
    for it in items:
        if it[0] == "text":
            out.append(texts[k])
            k += 1
        else:
            out.append(chat_k3.render_ids(tok, it[1], thinking=it[2], add_generation_prompt=False))
    return out


def _worker_init(_):
    # workers must die quietly on the DataLoader's SIGTERM, not run the trainer's handler
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the main process


def make_loader(tok_dir, seq_len, batch, seed, workers, pin, gsm_path=None):
    if torch is None:
        raise ImportError("tools/train/data.py: the training stream needs torch (pip install torch)")
    ds = PackedStream(tok_dir, seq_len, batch, seed, gsm_path)
    if workers <= 0:
        return iter(ds)
    return iter(DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=pin, prefetch_factor=4,
                           persistent_workers=True, worker_init_fn=_worker_init))


def eval_prompts(gsm, tok, n, seed=EVAL_SEED, shots=4, split="train"):
    """n (prompt ids, answer) pairs: few-shot prompts in the generator's own format (its
    few_shot_prompt / fewshot_examples when present), ending in "Answer:"."""
    probs = gsm.make_problems(split, n, seed)
    if hasattr(gsm, "few_shot_prompt") and hasattr(gsm, "fewshot_examples"):
        sh = gsm.fewshot_examples()[:shots] if shots else []
        texts = [gsm.few_shot_prompt(p["question"], sh) for p in probs]
    else:
        sh = gsm.make_problems("train", shots, seed + 1) if shots else []
        head = SEP.join(gsm.format_example(s) for s in sh)
        texts = [(head + SEP if head else "") + "Question: " + p["question"] + "\nAnswer:" for p in probs]
    return [(tok.encode(t), str(p["answer"])) for t, p in zip(texts, probs)]


_ANS = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")


def extract_answer(text: str):
    m = _ANS.search(text.split(SEP)[0])
    return m.group(1).replace(",", "") if m else None
