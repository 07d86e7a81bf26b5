"""Tokenizer loading for the trainer: a Kimi tiktoken folder (tiktoken.model + tokenizer_config.json)
as a `tiktoken.Encoding`, with the special-id layout of docs/model.md §9.1/§9.3 (ranks 0..n-1, then 256
special slots n..n+255, named from added_tokens_decoder, the rest <|reserved_token_{id}|>)."""
import base64
import json
import os

# docs/model.md §9.2, verbatim (tiktoken's Rust regex supports the `&&` class intersection).
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

N_SPECIAL = 256


class Tokenizer:
    """Thin wrapper: ids of the specials the trainer needs plus encode/decode of plain text."""

    def __init__(self, folder: str):
        import tiktoken

        self.folder = folder
        ranks = {}
        with open(os.path.join(folder, "tiktoken.model"), "rb") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        self.n_ranks = len(ranks)
        if sorted(ranks.values()) != list(range(self.n_ranks)):
            raise ValueError(f"{folder}/tiktoken.model: ranks are not 0..{self.n_ranks - 1}")
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            tc = json.load(f)
        self.config = tc
        named = {int(k): v["content"] for k, v in tc.get("added_tokens_decoder", {}).items()}
        self.vocab_size = self.n_ranks + N_SPECIAL
        specials = {}
        for i in range(self.n_ranks, self.vocab_size):
            specials[named.get(i, f"<|reserved_token_{i}|>")] = i
        self.special_ids = specials
        self.enc = tiktoken.Encoding(name=f"kimi:{os.path.abspath(folder)}", pat_str=KIMI_PAT,
                                     mergeable_ranks=ranks, special_tokens=specials)

        def sid(key, default_offset):
            name = tc.get(key)
            if isinstance(name, dict):
                name = name.get("content")
            return specials.get(name, self.n_ranks + default_offset)

        # Offsets mirror K3's layout (163584 + k) when the config does not name the token.
        self.bos_id = sid("bos_token", 0)
        self.eos_id = sid("eos_token", 2)
        self.pad_id = sid("pad_token", 255)
        self.media_pad_id = specials.get("<|media_pad|>", self.n_ranks + 21)
        self.mask_id = self.n_ranks + 253  # K3-DSpark's mask token 163837 = 163584 + 253, a reserved slot

    def encode(self, text: str) -> list:
        return self.enc.encode_ordinary(text)  # plain text: special strings stay text (§9.1, K3)

    def encode_batch(self, texts: list) -> list:
        return self.enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) < self.n_ranks]
        return self.enc.decode(ids, errors="replace")
