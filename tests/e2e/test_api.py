"""The OpenAI-compatible endpoints through the official `openai` client and raw HTTP."""

import http.client
import json
import re

from conftest import MODEL_NAME

PROMPT = "The quick brown fox"


def test_health_and_models(server, client):
    status, _, body = server.request("GET", "/health")
    assert status == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    m = models.data[0]
    assert m.owned_by == "deltaserve"
    assert m.object == "model"
    assert m.model_extra["max_model_len"] >= 512


def test_completion_greedy_is_deterministic(client, greedy):
    r1 = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                   temperature=0, extra_body={"ignore_eos": True})
    r2 = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert r1.object == "text_completion"
    assert r1.id.startswith("cmpl-") and r1.id != r2.id
    assert r1.model == MODEL_NAME
    c = r1.choices[0]
    assert c.index == 0 and c.finish_reason == "length"
    assert c.text == r2.choices[0].text
    assert c.text == greedy(PROMPT, 12)[0]
    assert r1.usage.completion_tokens == 12
    assert r1.usage.total_tokens == r1.usage.prompt_tokens + 12


def test_max_tokens_gives_length(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    r = client.chat.completions.create(model=MODEL_NAME, max_completion_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4


def test_stream_equals_non_stream(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # without include_usage no usage chunk comes
    chunks = list(client.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in chunks)


def test_chat_stream_and_plain(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert plain.object == "chat.completion"
    msg = plain.choices[0].message
    assert msg.role == "assistant"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    # K3 thinks by default: the thought and the answer reassemble separately
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                      for c in chunks if c.choices)
    assert text == (msg.content or "")
    assert thought == (msg.reasoning_content or "")
    assert text or thought
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 10


def test_raw_sse_framing(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": 5, "stream": True, "temperature": 0,
         "ignore_eos": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.getheader("Content-Type").startswith("text/event-stream")
    raw = r.read().decode()
    conn.close()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: {") and "\n" not in e
        json.loads(e[6:])


def test_chat_tools_reach_the_prompt(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    base = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=1,
                                                tools=tools)
    assert with_tools.usage.prompt_tokens > base.usage.prompt_tokens + 10


def test_stop_strings(client, greedy):
    text, _ = greedy(PROMPT, 24)
    m = re.search(r"[A-Za-z]{2}", text[2:])
    assert m, f"no ASCII pair to stop on in {text!r}"
    stop = m.group(0)
    want = text[:text.index(stop)]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=[stop, "\u2603never"], extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    # streamed: the stop string never shows, the text is the same
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24,
                                            temperature=0, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client, greedy):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.tokens == greedy(PROMPT, 6)[1]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0
        assert 1 <= len(top) <= 3
        # greedy: the sampled token is the most likely one
        assert abs(val - max(top.values())) < 1e-4
        if tok in top:
            assert abs(top[tok] - val) < 1e-5


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=5, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4
        assert isinstance(e.bytes, list) and len(e.bytes) >= 1
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].logprobs is None


def test_n_choices(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                  n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1  # greedy: all the same
    assert r.usage.completion_tokens == 24
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1,
                                  n=4, seed=7, extra_body={"ignore_eos": True})
    assert len({c.text for c in r.choices}) > 1  # sampled choices differ
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                            temperature=1, n=2, seed=7, stream=True,
                                            extra_body={"ignore_eos": True}))
    per = {0: "", 1: ""}
    for c in chunks:
        per[c.choices[0].index] += c.choices[0].text
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                      temperature=1, n=2, seed=7, extra_body={"ignore_eos": True})
    assert per == {c.index: c.text for c in again.choices}


def test_seeds(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a = sample(123)
    assert sample(123) == a
    assert any(sample(s) != a for s in (1, 2, 3))


def test_prompt_as_token_ids(server, client):
    status, tok = server.post_json("/tokenize", {"prompt": PROMPT})
    assert status == 200
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model=MODEL_NAME, prompt=tok["tokens"], max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == tok["count"] == by_text.usage.prompt_tokens


def test_tokenize_detokenize_round_trip(server, client):
    text = "Hello, world! Ünïcödé 你好 ok"
    status, r = server.post_json("/tokenize", {"prompt": text})
    assert status == 200
    assert r["count"] == len(r["tokens"]) > 3
    assert r["max_model_len"] >= 512
    status, d = server.post_json("/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and d["prompt"] == text
    # the messages form counts what a chat completion's prompt has
    msgs = [{"role": "user", "content": "Hi there"}]
    status, r = server.post_json("/tokenize", {"messages": msgs})
    assert status == 200
    chat = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens
    status, err = server.post_json("/detokenize", {"tokens": [1, -5]})
    assert status == 400 and "tokens[1]" in err["error"]["message"]


def test_metrics_names(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3)
    status, h, body = server.request("GET", "/metrics")
    assert status == 200
    assert h["content-type"].startswith("text/plain")
    text = body.decode()
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "state_slot_usage_perc", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "request_success_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_sum"]:
        assert f"deltaserve:{name}" in text, name
    m = server.metrics()
    assert m["deltaserve:generation_tokens_total"] >= 3
    assert m["deltaserve:e2e_request_latency_seconds_count"] >= 1
    assert m['deltaserve:request_success_total{finished_reason="length"}'] >= 1
    assert m["vllm:engine_stalls_total"] == 0  # (test_engine_engine makes one and counts it)
