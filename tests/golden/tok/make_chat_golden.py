#!/usr/bin/env python3
"""Writes chat_k3.json: K3 prompts rendered by the reference encoder, checked by test_text_chat.c.

The reference is Moonshot's encoding_k3.py as published in NVIDIA-NeMo/Automodel
(nemo_automodel/components/models/kimi_k3/encoding.py); it is not vendored here. Its segments are
tokenized the way tokenization_kimi.py does it — markers with specials allowed, every other
segment on its own with specials disallowed — by tiktoken on the committed vocab2048_k3.

Usage: python3 make_chat_golden.py /path/to/encoding.py
"""
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_golden import load_encoding  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get weather \u00e9 \"q\"",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1.0},
        "n": {"type": "integer", "maximum": 1e16}}, "required": ["city"]}}}]

CONV = [
    {"role": "system", "content": "Be terse & <|open|> careful."},
    {"role": "user", "content": "Weather in Paris?", "name": "A&B \"x\""},
    {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
            {"city": "Paris", "days": 2, "x": 1.5,
             "deep": {"b": [1, 2.0, None], "a": "\u00e9\n"}, "t": True})}},
        {"id": "b", "type": "function", "function": {"name": "f2", "arguments": "{broken"}},
        {"id": "c", "type": "function", "function": {"name": "f3", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "c", "content": "rc"},
    {"role": "tool", "tool_call_id": "a",
     "content": [{"type": "text", "text": "part1 "}, {"type": "text", "text": "(part2)."}]},
    {"role": "tool", "tool_call_id": "b", "content": "rb"},
    {"role": "assistant", "content": "It is 18 C.", "reasoning": "  "},
    {"role": "user", "content": [{"type": "text", "text": "thanks!!"},
                                 {"type": "text", "text": " and 1234567"}]},
    {"role": "system", "content": "",
     "tools": [{"type": "function", "function": {"name": "z", "parameters": {"b": 1, "a": 2}}}]},
    {"role": "assistant", "content": "ok", "name": "bot (1)."},
    {"role": "tool", "content": "unresolved", "name": "zz"},
]

CASES = [
    {"messages": CONV, "tools": TOOLS, "opts": {}},
    {"messages": CONV, "tools": TOOLS,
     "opts": {"thinking": False, "tool_choice": "none", "response_format": {"type": "json_object"}}},
    {"messages": CONV[:3], "tools": None,
     "opts": {"thinking_effort": "max", "tool_choice": "required",
              "response_format": {"type": "json_schema", "json_schema": {
                  "name": "x", "schema": {"z": 1, "a": {"d": 0.5, "c": [1e-7]}}}}}},
    {"messages": [{"role": "user", "content": "  lead and trail  \n"}], "tools": [],
     "opts": {"add_generation_prompt": False}},
]


def main():
    spec = importlib.util.spec_from_file_location("encoding_k3", sys.argv[1])
    ref = importlib.util.module_from_spec(spec)
    sys.modules["encoding_k3"] = ref  # dataclasses look their module up while the class is made
    spec.loader.exec_module(ref)
    enc = load_encoding(os.path.join(HERE, "vocab2048_k3"))
    out = []
    for c in CASES:
        o = c["opts"]
        kw = {k: o[k] for k in ("tool_choice", "response_format", "thinking_effort") if k in o}
        segs = ref.build_chat_segments(c["messages"], c["tools"],
                                       add_generation_prompt=o.get("add_generation_prompt", True),
                                       thinking=o.get("thinking", True), **kw)
        ids = []
        for s in segs:
            ids += (enc.encode(s.text, allowed_special="all") if s.allow_special
                    else enc.encode(s.text, disallowed_special=()))
        out.append(dict(c, text="".join(s.text for s in segs), ids=ids))
    with open(os.path.join(HERE, "chat_k3.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
