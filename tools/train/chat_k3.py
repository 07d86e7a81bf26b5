"""The K3 chat format (docs/model.md §9.5) for training data, segment by segment as the C engine
renders it (src/text/chat_k3.c): markers <|open|> <|sep|> <|close|> <|end_of_msg|> are special ids
and every other segment (tag name, each piece of an attribute, content) is encoded on its own, so
BPE merges never cross a segment boundary.  Only what the training data uses is supported: system,
user and assistant messages with string content, an optional name, and an assistant's
reasoning_content (thinking mode); no tools.  tests/e2e/test_chat_render.py checks the ids
against the server's /tokenize."""

MARKERS = ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>")


def _attr(segs, key, val):
    # chat_k3.c k3_attr: " key", "=\"", escaped value, "\"" (4 segments; empty ones dropped)
    val = val.replace("&", "&amp;").replace('"', "&quot;")
    segs += [("t", " " + key), ("t", '="'), ("t", val), ("t", '"')]


def _open(segs, tag, attrs=()):
    segs += [("m", "<|open|>"), ("t", tag)]
    for k, v in attrs:
        _attr(segs, k, v)
    segs.append(("m", "<|sep|>"))


def _close(segs, tag):
    segs += [("m", "<|close|>"), ("t", tag), ("m", "<|sep|>")]


def _end_message(segs):
    _close(segs, "message")
    segs.append(("m", "<|end_of_msg|>"))


def render_segments(messages, thinking=True, add_generation_prompt=True):
    """messages -> [(kind, text)], kind "m" (marker) or "t" (text), empty text segments dropped."""
    segs = []
    for i, m in enumerate(messages):
        role = m["role"]
        if m.get("tools") or m.get("tool_calls"):
            raise ValueError(f"messages[{i}]: tools are not supported by the training renderer")
        attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
        content = m.get("content") or ""
        if role in ("system", "user"):
            _open(segs, "message", attrs)
            segs.append(("t", content))
            _end_message(segs)
        elif role == "assistant":
            _open(segs, "message", attrs)
            if thinking:
                rv = m.get("reasoning_content")
                if not isinstance(rv, str) or not rv:
                    rv = m.get("reasoning")
                _open(segs, "think")
                if isinstance(rv, str) and rv.strip():
                    segs.append(("t", rv))
                _close(segs, "think")
            _open(segs, "response")
            segs.append(("t", content))
            _close(segs, "response")
            _end_message(segs)
        else:
            raise ValueError(f"messages[{i}]: role {role!r} not supported by the training renderer")
    if add_generation_prompt:
        _open(segs, "message", [("role", "assistant")])
        _open(segs, "think" if thinking else "response")
    return [(k, s) for k, s in segs if s]


def render_ids(tok, messages, thinking=True, add_generation_prompt=True):
    """Token ids of the rendered conversation (tok: tools/train/tok.Tokenizer)."""
    ids = []
    for kind, s in render_segments(messages, thinking, add_generation_prompt):
        if kind == "m":
            ids.append(tok.special_ids[s])
        else:
            ids.extend(tok.encode(s))
    return ids


def render_text(messages, thinking=True, add_generation_prompt=True):
    """The same prompt as one string, markers by name (for reading and the tokenizer corpus)."""
    return "".join(s for _, s in render_segments(messages, thinking, add_generation_prompt))
