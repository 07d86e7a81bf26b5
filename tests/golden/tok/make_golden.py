#!/usr/bin/env python3
"""Writes the tokenizer golden vectors checked by tests/unit/test_text_tokenizer.c.

Independent references (none of them is the C code):
  * splits.json      — pieces of the docs/model.md §9.2 pattern in its original form, with `&&` class
                       intersection, run by the Python `regex` module (V1); cross-checked against the
                       lookahead rewrite that the C code hands to PCRE2.
  * ids_<vocab>.json — tiktoken (Rust core, the library Moonshot's tokenization_kimi.py wraps) built
                       from the committed vocabulary folder and the original pattern, with the
                       wrapper's 400,000-char chunking and 25,000-char run cuts. Long inputs are
                       stored as (count, FNV-1a hash, head, tail) to keep the files small.

The vocabulary folders (vocab768_kimi_linear/, vocab2048_k3/) were written by the C trainer
ds_tok_write_files(); the C test regenerates them and checks they are byte-identical.

Usage: pip install regex tiktoken; python3 make_golden.py   (Unicode data must be <= the PCRE2's
Unicode version for the random strings; the pool below sticks to characters stable since 2010.)
"""
import base64
import json
import os
import random

import regex
import tiktoken

HERE = os.path.dirname(os.path.abspath(__file__))

NH_U = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
NH_L = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
CONTR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + NH_U + "*" + NH_L + "+" + CONTR,
    r"[^\r\n\p{L}\p{N}]?" + NH_U + "+" + NH_L + "*" + CONTR,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
LA_U = r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"
LA_L = r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])"
PAT_LOOKAHEAD = PAT.replace(NH_U, LA_U).replace(NH_L, LA_L)

CURATED = [
    "Hello world",
    "Hello, world! How's it going? I'm fine; they're here, we've won, you'll see, he'd go.",
    "IT'S DONE. WE'RE BACK. I'M SURE YOU'LL SEE THEY'VE GONE, HE'D SAY. Don'T x'ſ",
    "CamelCaseWords and HTTPServer, iPhone XMLHttpRequest McDonald's",
    "你好、世界々",
    "你好世界。今天天气很好！我们去公园吧",
    "Hello世界abc漢字〇々ｶﾀｶﾅ カタカナ ひらがな",
    "日本語の文章：「こんにちは」と言いました。",
    "한국어 텍스트입니다. 안녕하세요!",
    "Привет, мир! Ελληνικά κείμενα. Ǆemal ǅemal ǆemal",
    "مرحبا بالعالم ١٢٣٤٥ עברית",
    "हिन्दी में लिखा गया पाठ। क्षत्रिय",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Combining: e\u0301 a\u0308 n\u0303 \u0301\u0302x Z\u0351\u0362\u0334 ",
    "Emoji: 😀😃 👍🏽 👨\u200d👩\u200d👧 🇫🇷🇩🇪 ❤\ufe0f ☃ ✓",
    "Digits: 1 12 123 1234 12345 1234567890 3.14159 1,000,000 ٣٤٥ ⅫⅣ ²³",
    "Spaces:   three   then\ttab\t\tand  \n  newline\n\n\nthree newlines",
    "Windows\r\nline\r\n\r\nendings\rCR only",
    "trailing spaces    \n    leading spaces",
    "     ",
    "\n",
    " \n \n ",
    "x\u180ey nb\u00a0sp id\u3000sp en\u2002sp\u2028ls\u2029ps \u0085nel \u000bvt \u000cff \u001cfs",
    "code: for (int i = 0; i < n; i++) { a[i] += b[i] * 2; } // done",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "<|im_end|> <|im_user|>user<|im_middle|>hi<|im_end|>[BOS][EOS]",
    "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>",
    "<|reserved_token_163700|><|im_end",
    "punctuation!!! ??? ... --- *** ((( ))) \"quoted\" 'single' `back`",
    "URL https://example.com/path?q=1&r=2#frag email a.b@c.de",
    "$100.00 €50 £20 ¥1000 ₹99 100% #hashtag @mention",
    "ǅungla Ǉudevit ǈ ǉ ʰʲʷ ˢ ꜰ",
    "mixed: a1b2c3 A1B2 1a 1A _under_score_ snake_case __dunder__",
    "'s 's 'S 'll 'LL 'Ll test's tests' o'clock rock'n'roll",
    "x" * 40 + " " + "1" * 20 + " " + " " * 30 + "z",
    "tab\t\t\tx  \t  y\n\t\n",
    "Ａｂｃ　全角スペース　１２３",
    "\U00020000\U0002A6D6 𠀀 ext-b han",
    "🙂🙂🙂abc🙂 🙂",
    "a\u0300\u0301\u0302\u0303\u0304 \u0300abc",
    "ß ẞ ﬁ ﬀ Ω Å K",
    "",
]

POOL = (
    list("abcdefghijklmnopqrstuvwxyz") * 6 + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") * 3 +
    list("0123456789") * 3 + [" "] * 30 + ["\n", "\r", "\t", "\n", "  "] +
    list(".,;:!?'\"()[]{}<>|/\\-_+=*&^%$#@~`") +
    ["'s", "'t", "'re", "'LL", "'D"] +
    list("你好世界中文字漢々〇、。「」") + list("ひらがなカタカナ") + list("한국어") +
    list("éèêëñçøåæœ") + list("ÉÑÇ") + list("αβγΔΣ") + list("абвгдЖЩ") +
    list("مرحبا") + list("हिन्दी") + list("ไทย") +
    ["\u0301", "\u0308", "\u200d", "\ufe0f", "😀", "👍", "🏽", "🇫", "🇷", "\u00a0", "\u3000",
     "\u2003", "\u0085", "\u180e", "ǅ", "ʰ", "٣", "Ⅻ", "²", "\u000b", "\u000c", "<|im_end|>",
     "<|open|>", "<|sep|>"]
)


def random_strings(n, seed=1234):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        out.append("".join(rng.choice(POOL) for _ in range(k)))
    return out


# Long inputs exercising Moonshot's caps: text = unit * repeat + suffix.
LONG = [
    {"unit": "the", "repeat": 8334, "suffix": " end"},           # one 25,002-letter run: cut once
    {"unit": " ", "repeat": 30000, "suffix": "x"},               # whitespace run over the cap
    {"unit": "\u4f60", "repeat": 26000, "suffix": "\u3002ok"},   # Han run over the cap
    {"unit": "words ", "repeat": 70000, "suffix": "!"},          # 420,001 chars: one 400k chunk cut
    {"unit": "ab1 ", "repeat": 7000, "suffix": ""},              # under the caps
]


def split_ws(s, max_len):
    """Moonshot's cut of runs of more than max_len whitespace / non-whitespace characters."""
    cur_len = 0
    cur_space = s[0].isspace() if s else False
    start = 0
    for i in range(len(s)):
        sp = s[i].isspace()
        if cur_space ^ sp:
            cur_len = 1
            cur_space = sp
        else:
            cur_len += 1
            if cur_len > max_len:
                yield s[start:i]
                start = i
                cur_len = 1
    yield s[start:]


def moonshot_encode(enc, text, allow_special):
    ids = []
    for i in range(0, len(text), 400_000):
        for sub in split_ws(text[i:i + 400_000], 25_000):
            if allow_special:
                ids.extend(enc.encode(sub, allowed_special="all"))
            else:
                ids.extend(enc.encode(sub, disallowed_special=()))
    return ids


def fnv(ids):
    h = 1469598103934665603
    for x in ids:
        h = ((h ^ (x & 0xFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def load_encoding(vdir):
    ranks = {}
    with open(os.path.join(vdir, "tiktoken.model"), "rb") as f:
        for line in f:
            if line.strip():
                b, r = line.split()
                ranks[base64.b64decode(b)] = int(r)
    cfg = json.load(open(os.path.join(vdir, "tokenizer_config.json")))
    n = len(ranks)
    named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding(name=os.path.basename(vdir), pat_str=PAT, mergeable_ranks=ranks,
                             special_tokens=specials)


def main():
    texts = CURATED + random_strings(400)
    pat = regex.compile(PAT, flags=regex.V1)
    pat_la = regex.compile(PAT_LOOKAHEAD)
    splits = []
    for t in texts:
        pieces = pat.findall(t)
        assert "".join(pieces) == t, repr(t)
        assert pat_la.findall(t) == pieces, "lookahead rewrite differs on %r" % t
        splits.append({"text": t, "pieces": pieces})
    assert [p for p in splits if p["text"] == "你好、世界々"][0]["pieces"] == ["你好", "、", "世界々"]
    with open(os.path.join(HERE, "splits.json"), "w", encoding="utf-8") as f:
        json.dump(splits, f, ensure_ascii=False, indent=0)
        f.write("\n")

    for vname in ("vocab768_kimi_linear", "vocab2048_k3"):
        enc = load_encoding(os.path.join(HERE, vname))
        out = {"vocab": vname, "ordinary": [], "special": [], "long": []}
        for t in texts:
            out["ordinary"].append(moonshot_encode(enc, t, False))
            out["special"].append(moonshot_encode(enc, t, True))
            assert enc.decode_bytes(out["ordinary"][-1]) == t.encode()
        for spec in LONG:
            text = spec["unit"] * spec["repeat"] + spec["suffix"]
            ids = moonshot_encode(enc, text, False)
            assert enc.decode_bytes(ids) == text.encode()
            out["long"].append(dict(spec, n=len(ids), fnv=fnv(ids), head=ids[:16], tail=ids[-16:]))
        with open(os.path.join(HERE, "ids_%s.json" % vname), "w") as f:
            json.dump(out, f, separators=(",", ":"))
            f.write("\n")


if __name__ == "__main__":
    main()
