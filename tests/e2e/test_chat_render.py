"""The trainer's K3 chat renderer (tools/train/chat_k3.py) gives the same token ids as the server's
rendering of /v1/chat/completions prompts (/tokenize with messages), so that the chat examples the
model is trained on are exactly what it is served (issue 37).  Conversations: generated training
conversations of tools/data/gsm2.py plus edge cases (names with & and ", empty and missing
reasoning, multi-turn, non-ASCII), with and without the generation prompt, thinking on and off."""
import os
import random
import sys

import pytest

from conftest import DS_MODEL

import tiktoken  # noqa: F401,E402  (make deps installs it: the comparison needs the tokenizer)
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tools", "train"))
sys.path.insert(0, os.path.join(REPO, "tools", "data"))
import chat_k3  # noqa: E402
import gsm2  # noqa: E402
from tok import Tokenizer  # noqa: E402

EDGE = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You solve math word problems step by step."},
     {"role": "user", "content": "Mia has 23 apples. She buys 3 bags with 12 apples in each bag. "
                                 "How many apples does she have now?"}],
    [{"role": "user", "name": 'A&B "q"', "content": "Ünïcödé 你好 2 + 2?"},
     {"role": "assistant", "reasoning_content": "2 + 2 = 4.", "content": "The answer is 4.\n#### 4"},
     {"role": "user", "content": "and 3 * 3?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! Send me a problem."},
     {"role": "user", "content": ""}],
]


def _conversations():
    items = gsm2.make_stream_items(40, 5, chat_share=1.0)
    return EDGE + [it[1] for it in items if it[0] == "chat"][:12]


@pytest.mark.parametrize("thinking", [True, False])
def test_python_render_matches_server(server, thinking):
    tok = Tokenizer(DS_MODEL)
    n = 0
    for msgs in _conversations():
        for gen in (True, False):
            if not gen and msgs[-1]["role"] != "assistant":
                continue
            body = {"messages": msgs, "add_generation_prompt": gen,
                    "chat_template_kwargs": {"thinking": thinking}}
            status, r = server.post_json("/tokenize", body)
            assert status == 200, r
            want = r["tokens"]
            got = chat_k3.render_ids(tok, msgs, thinking=thinking, add_generation_prompt=gen)
            assert got == want, (msgs, gen, tok.decode(got), tok.decode(want))
            n += 1
    assert n >= 12


def test_training_text_continues_the_served_prompt():
    """A full conversation's ids start with the served prompt for its last assistant turn, so the
    model learns to continue exactly what the server sends."""
    tok = Tokenizer(DS_MODEL)
    rng = random.Random(3)
    for msgs in _conversations():
        if msgs[-1]["role"] != "assistant":
            continue
        th = rng.random() < 0.5
        full = chat_k3.render_ids(tok, msgs, thinking=th, add_generation_prompt=False)
        prompt = chat_k3.render_ids(tok, msgs[:-1], thinking=th, add_generation_prompt=True)
        assert full[: len(prompt)] == prompt
        assert full[-1] == tok.special_ids["<|end_of_msg|>"]
