"""Structured outputs end to end (issue 34): response_format json_schema / json_object and
tool_choice required / named, enforced by constrained decoding (llguidance, text/grammar.h).

The model of `make test` has random weights, so nothing but the grammar keeps its output in
shape: 200 requests sampled at temperature 1 over varied schemas (nested objects, arrays, enums,
required fields, bounded numbers, strings whose random bytes need escapes) must all end with
"stop" and validate against their schema (jsonschema); enforced tool calls must parse and their
arguments validate against the tool's parameters. The shared server runs whatever DS_SERVE_ARGS
says (make test runs this file plain, with DSpark and under -tp 2 -pp 2); n-gram speculation gets
a server of its own here. Strings and arrays carry maxLength / maxItems: a random model closes a
string only when it happens to draw a quote, and an output cut by max_tokens cannot validate.
Without llguidance the server must refuse such requests clearly and serve the rest."""
import importlib.util
import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MODEL_NAME, Server
from openai.lib.streaming.chat import ChatCompletionStreamState

HAVE_LLG = importlib.util.find_spec("llguidance") is not None


@pytest.fixture
def _llg():
    """make deps installs llguidance: without it these tests fail (they are never skipped)."""
    if not HAVE_LLG:
        pytest.fail("llguidance is not installed (run make deps)")


needs_llg = pytest.mark.usefixtures("_llg")
import jsonschema  # noqa: E402  (make deps installs it)

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10,
                                                         "maximum": 10},
                                                   "y": {"type": "number"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": {"enum": ["red", "green", "blue"]}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1,
     "maxItems": 4},
    {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                    "maximum": 999},
                                             "note": {"anyOf": [S, {"type": "null"}]}},
            "required": ["id", "note"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"enum": ["yes", "no", 3, None]},
    {"type": "object", "properties": {"text": {"type": "string", "minLength": 2,
                                               "maxLength": 4},
                                      "n": {"type": "number", "exclusiveMinimum": 0,
                                            "maximum": 1}},
     "required": ["text"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "v1"},
                                      "data": {"type": "object", "properties": {"a": S},
                                               "additionalProperties": False}},
     "required": ["kind", "data"], "additionalProperties": False},
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": S, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "no_args"}},
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
          for t in TOOLS}
MSGS = [{"role": "user", "content": "Answer in JSON."}]


def _schema_request(client, i, thinking):
    schema = SCHEMAS[i % len(SCHEMAS)]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, temperature=1.0, max_tokens=300, seed=1000 + i,
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema,
                                         "strict": True}},
        extra_body={"chat_template_kwargs": {"thinking": thinking}})
    return schema, r.choices[0]


def _check_schema_outputs(client, n, workers=16):
    with ThreadPoolExecutor(workers) as ex:
        outs = list(ex.map(lambda i: _schema_request(client, i, i % 2 == 0), range(n)))
    for i, (schema, ch) in enumerate(outs):
        assert ch.finish_reason == "stop", (i, ch.message.content)
        value = json.loads(ch.message.content)
        jsonschema.validate(value, schema)
        assert not getattr(ch.message, "reasoning_content", None)  # the thought closed at once
    return outs


# 200 on the plain pass; the passes of make test with DS_SERVE_ARGS (DSpark, -tp 2 -pp 2: several
# times the compute per token on the CPU) repeat a part of it, which still meets every schema and
# every tool in every configuration
OTHER_PASS = bool(os.environ.get("DS_SERVE_ARGS"))
N_SCHEMA = 32 if OTHER_PASS else 200
N_TOOLS = 12 if OTHER_PASS else 24
# servers of their own, whatever DS_SERVE_ARGS says: run once, on the plain pass (conftest.py)
own_server = pytest.mark.once


@needs_llg
def test_json_schema_200_validate(client):
    outs = _check_schema_outputs(client, N_SCHEMA)
    # the outputs are sampled, not one forced string per schema
    assert len({ch.message.content for _, ch in outs}) > N_SCHEMA // 2


TOOL_MAX_TOKENS = 400  # the prompt (3 tools) is ~590 tokens of the shared server's 1024


def _tool_request(client, i, choice, parallel=None, stream=False):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, temperature=1.0, max_tokens=TOOL_MAX_TOKENS,
        seed=5000 + i, tools=TOOLS, tool_choice=choice, stream=stream,
        extra_body={"chat_template_kwargs": {"thinking": i % 2 == 0}}, **extra)


def _check_tool_calls(client, n, named, parallel=None):
    """n enforced-call requests; every call parses and its arguments validate. Named, or with
    parallel_tool_calls false: exactly one call, finish "tool_calls". "required" with parallel
    calls (the default): one or more, and the only other finish is running out of max_tokens
    in the middle of several calls (each call is ~70 tokens on this model). Returns the names
    called and the number of calls of each response, by request index."""
    choices = ["required"] if not named else [
        {"type": "function", "function": {"name": t["function"]["name"]}} for t in TOOLS]
    with ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(lambda i: (choices[i % len(choices)],
                                      _tool_request(client, i, choices[i % len(choices)],
                                                    parallel)),
                           range(n)))
    names, counts = set(), []
    for choice, r in outs:
        ch = r.choices[0]
        calls = ch.message.tool_calls or []
        if named or parallel is False:
            assert len(calls) == 1 and ch.finish_reason == "tool_calls", ch.message
        elif ch.finish_reason == "length":
            assert r.usage.completion_tokens == TOOL_MAX_TOKENS and len(calls) >= 2, ch.message
        else:
            assert ch.finish_reason == "tool_calls" and calls, ch.message
        assert len({c.id for c in calls}) == len(calls), calls  # ids tell the calls apart
        for call in calls:
            name = call.function.name
            names.add(name)
            if choice != "required":
                assert name == choice["function"]["name"]
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, PARAMS[name])
            assert name != "no_args" or args == {}  # no parameters: no arguments
        counts.append(len(calls))
    return names, counts


@needs_llg
def test_tool_choice_required_and_named(client):
    # required: any tool (more than one gets picked over the samples), and several calls in one
    # message (parallel_tool_calls defaults to true): the model draws another call or the end
    # of the tools section after each call, so some of the samples make two or more
    names, counts = _check_tool_calls(client, N_TOOLS, named=False)
    assert len(names) >= 2
    assert max(counts) >= 2, counts
    # named: exactly one call of that function, parallel_tool_calls or not (as vLLM)
    assert _check_tool_calls(client, N_TOOLS, named=True)[0] == set(PARAMS)


@needs_llg
def test_parallel_tool_calls_false_makes_one_call(client):
    # the same seeds as above, where several made two or more calls: now every one makes one
    names, counts = _check_tool_calls(client, N_TOOLS, named=False, parallel=False)
    assert counts == [1] * N_TOOLS and len(names) >= 2
    _check_tool_calls(client, len(TOOLS), named=True, parallel=False)


@needs_llg
def test_parallel_calls_stream_like_whole(client):
    """A response with several calls, streamed: the client's own accumulator rebuilds exactly the
    non-streamed calls (index 0, 1, ... each with its id and name first)."""
    for i in range(N_TOOLS):
        whole = _tool_request(client, i, "required").choices[0]
        if whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) >= 2:
            break
    else:
        pytest.fail("no sample made two calls")
    state = ChatCompletionStreamState()
    for chunk in _tool_request(client, i, "required", stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls] \
        == [(c.id, c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@needs_llg
def test_parallel_tool_calls_must_be_a_boolean(server):
    status, body = server.post_json("/v1/chat/completions", {
        "model": MODEL_NAME, "messages": MSGS, "max_tokens": 4, "tools": TOOLS,
        "tool_choice": "required", "parallel_tool_calls": "no"})
    assert status == 400 and body["error"]["param"] == "parallel_tool_calls", body


@needs_llg
def test_json_object_is_an_object(client):
    for i in range(6):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=MSGS, temperature=1.0, max_tokens=40, seed=i,
            response_format={"type": "json_object"},
            extra_body={"chat_template_kwargs": {"thinking": False}})
        text = r.choices[0].message.content
        assert text.startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


@needs_llg
def test_completions_follow_a_schema(client):
    """/v1/completions takes response_format as vLLM's does: the text itself follows the schema
    (no chat turn, no thinking before it), sampled, streamed or not."""
    def one(i):
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = client.completions.create(
            model=MODEL_NAME, prompt="A JSON value:", temperature=1.0, max_tokens=300, seed=i,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": f"c{i}", "schema": schema}}})
        return schema, r.choices[0]
    with ThreadPoolExecutor(8) as ex:  # side by side: one batch, as clients send them
        outs = list(ex.map(one, range(8)))
    for i, (schema, ch) in enumerate(outs):
        assert ch.finish_reason == "stop", (i, ch.text)
        jsonschema.validate(json.loads(ch.text), schema)
    assert len({ch.text for _, ch in outs}) > 4
    kw = dict(model=MODEL_NAME, prompt="A JSON value:", temperature=1.0, max_tokens=300, seed=3,
              extra_body={"response_format": {"type": "json_object"}})
    whole = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole and whole.startswith("{")


@needs_llg
def test_streamed_equals_whole(client):
    kw = dict(model=MODEL_NAME, messages=MSGS, temperature=1.0, max_tokens=200, seed=7,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "s", "schema": SCHEMAS[1]}})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SCHEMAS[1])


@needs_llg
def test_bad_requests_name_the_field(server):
    base = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format",
         "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": 5}}},
         "response_format", "expected a JSON schema object"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
         "response_format", "cannot be compiled"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "no tool is named"),
        ({"tool_choice": "required"}, "tool_choice", "needs \"tools\""),
    ]
    for extra, param, words in cases:
        status, body = server.post_json("/v1/chat/completions", {**base, **extra})
        assert status == 400, (extra, body)
        assert body["error"]["param"] == param, body
        assert words in body["error"]["message"], body
    # and the server is fine afterwards
    status, body = server.post_json("/v1/chat/completions", base)
    assert status == 200


@needs_llg
def test_grammar_cache_metrics(server):
    """/metrics counts the grammar cache: a schema never seen is compiled once, the same schema
    again is a hit; a schema llguidance refuses is a 400 and a compile failure."""
    tag = uuid.uuid4().hex  # a schema no earlier test sent
    schema = {"type": "object", "properties": {tag: {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": [tag], "additionalProperties": False}
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 8,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "m", "schema": schema}}}
    m0 = server.metrics()
    for _ in range(2):
        status, out = server.post_json("/v1/chat/completions", body)
        assert status == 200, out
    m1 = server.metrics()

    def delta(name, m_after=None):
        return (m_after or m1).get("deltaserve:" + name, 0) - m0.get("deltaserve:" + name, 0)
    assert delta("grammar_compiles_total") == 1
    # the second request's check, and the engine's matchers where this process samples
    assert delta("grammar_cache_hits_total") >= 1
    assert delta("grammar_compile_failures_total") == 0
    assert delta("grammar_compile_seconds_count") == 1
    assert 0 < delta("grammar_compile_seconds_sum") < 60
    assert m1["deltaserve:grammar_cache_entries"] >= 1
    assert m1["vllm:grammar_compiles_total"] == m1["deltaserve:grammar_compiles_total"]
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {tag: {"$ref": "#/nope"}}}}}}
    status, out = server.post_json("/v1/chat/completions", bad)
    assert status == 400 and "cannot be compiled" in out["error"]["message"], out
    m2 = server.metrics()
    assert delta("grammar_compile_failures_total", m2) == 1
    assert delta("grammar_compiles_total", m2) == 1
    assert delta("grammar_compile_seconds_count", m2) == 2


@needs_llg
@own_server
def test_ngram_speculation_keeps_the_grammar():
    """n-gram drafts copy earlier text (JSON repeats itself), so drafts the grammar forbids reach
    the verify and must be rejected at their row."""
    srv = Server("--speculative-method", "ngram", "--num-speculative-tokens", "4",
                 "--max-num-seqs", "16", "--seed", "3", env_args=False)
    try:
        client = srv.client()
        _check_schema_outputs(client, 24)
        _check_tool_calls(client, 6, named=False)
        m = srv.metrics()
        assert m.get("deltaserve:spec_decode_num_draft_tokens_total", 0) > 0, m
    finally:
        assert srv.stop() == 0


@own_server
def test_without_the_library_requests_are_refused_clearly(monkeypatch):
    monkeypatch.setenv("DS_LLGUIDANCE_LIB", "/nonexistent/llguidance.so")
    srv = Server("--max-num-seqs", "4", env_args=False)
    try:
        status, body = srv.post_json("/v1/chat/completions", {
            "model": MODEL_NAME, "messages": MSGS, "max_tokens": 4,
            "response_format": {"type": "json_object"}})
        assert status == 400, body
        assert body["error"]["param"] == "response_format"
        assert "not available" in body["error"]["message"]
        assert "/nonexistent/llguidance.so" in body["error"]["message"]
        status, body = srv.post_json("/v1/chat/completions", {
            "model": MODEL_NAME, "messages": MSGS, "max_tokens": 4})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        status, _, raw = srv.request("GET", "/v1/models")
        caps = json.loads(raw)["data"][0]["capabilities"]
        assert caps["structured_outputs"] is False and caps["tool_choice"] == ["auto", "none"]
        status, body = srv.post_json("/v1/chat/completions", {
            "model": MODEL_NAME, "messages": MSGS, "max_tokens": 4, "tools": TOOLS,
            "tool_choice": "required"})
        assert status == 400 and body["error"]["param"] == "tool_choice", body
    finally:
        assert srv.stop() == 0
