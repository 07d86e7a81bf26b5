"""Every error the API promises: OpenAI error shape, the right status, the field named, and no
harm to other requests."""

import http.client
import json
import threading

import openai
import pytest

from conftest import MODEL_NAME, Server, _server_fixture, sse_events


def error_of(server, path, body, status, headers=None):
    got, h, data = server.request("POST", path, body, headers)
    assert got == status, (got, data[:300])
    e = json.loads(data)["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert e["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return e, h


def test_malformed_json(server):
    e, _ = error_of(server, "/v1/completions", '{"prompt": "x", ', 400)
    assert "invalid JSON" in e["message"]
    e, _ = error_of(server, "/v1/chat/completions", "[]", 400)
    assert "JSON object" in e["message"]


@pytest.mark.parametrize("field,value,words", [
    ("temperature", "hot", "temperature: expected a number, got string"),
    ("max_tokens", "10", "max_tokens: expected an integer"),
    ("n", 1.5, "n: expected an integer"),
    ("stop", 7, "stop: expected a string or a list"),
    ("stream", "yes", "stream: expected a boolean"),
    ("logprobs", True, "logprobs: expected an integer"),
    ("prompt", {"a": 1}, "prompt: expected a string or a list of token ids"),
    ("seed", "x", "seed: expected an integer"),
])
def test_wrong_types(server, field, value, words):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, field: value}
    e, _ = error_of(server, "/v1/completions", body, 400)
    assert words in e["message"]
    assert e["param"] == field


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("n", 0), ("n", 17), ("max_tokens", 0), ("logprobs", 21), ("presence_penalty", -3),
    ("frequency_penalty", 2.5), ("min_tokens", -1),
])
def test_out_of_range(server, field, value):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, field: value}
    e, _ = error_of(server, "/v1/completions", body, 400)
    assert e["param"] == field and field in e["message"]


def test_chat_out_of_range_and_types(server):
    base = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    e, _ = error_of(server, "/v1/chat/completions", {**base, "logprobs": True,
                                                      "top_logprobs": 21}, 400)
    assert e["param"] == "top_logprobs"
    e, _ = error_of(server, "/v1/chat/completions", {**base, "logprobs": 2}, 400)
    assert "logprobs: expected a boolean" in e["message"]
    e, _ = error_of(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400)
    assert e["param"] == "messages"
    e, _ = error_of(server, "/v1/chat/completions",
                    {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400)
    assert "messages" in e["message"]
    e, _ = error_of(server, "/v1/completions", {"prompt": ["a", "b"]}, 400)
    assert "one prompt" in e["message"]
    e, _ = error_of(server, "/v1/completions", {"prompt": "x", "echo": True}, 400)
    assert e["param"] == "echo"


def test_unknown_model_404(server, client):
    with pytest.raises(openai.NotFoundError) as ex:
        client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
    assert ex.value.status_code == 404
    assert ex.value.code == "model_not_found"
    e, _ = error_of(server, "/v1/chat/completions",
                    {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"


def test_context_length(server, client):
    limit = client.models.list().data[0].model_extra["max_model_len"]
    ids = [5] * (limit - 100)
    with pytest.raises(openai.BadRequestError) as ex:
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=200)
    msg = ex.value.body["message"]
    assert f"maximum context length is {limit} tokens" in msg
    assert f"{limit - 100} in the prompt, 200 in the completion" in msg
    # the prompt alone is too long
    e, _ = error_of(server, "/v1/completions", {"prompt": [5] * limit}, 400)
    assert str(limit) in e["message"] and e["code"] == "context_length_exceeded"
    # exactly at the limit is fine
    r = client.completions.create(model=MODEL_NAME, prompt=[5] * (limit - 2), max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == limit


def test_unknown_path_and_method(server):
    status, _, data = server.request("GET", "/v1/nothing")
    assert status == 404 and json.loads(data)["error"]["code"] == "not_found"
    status, h, data = server.request("GET", "/v1/completions")
    assert status == 405 and h["allow"] == "POST"
    assert json.loads(data)["error"]["code"] == "method_not_allowed"
    status, h, _ = server.request("POST", "/v1/models", {})
    assert status == 405 and "GET" in h["allow"]
    status, _, _ = server.request("DELETE", "/health")
    assert status == 405


def test_body_too_large(server):
    big = '{"prompt": "' + "a" * (17 << 20) + '"}'
    e, _ = error_of(server, "/v1/completions", big, 413)
    assert "limit" in e["message"]
    # the server is fine afterwards
    assert server.request("GET", "/health")[0] == 200


def test_bad_requests_do_not_disturb_others(server, greedy):
    """A stream runs while malformed and invalid requests hammer the server."""
    prompt = "A bad neighbour"
    want, _ = greedy(prompt, 40)
    got = {}

    def stream():
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
             "stream": True}), headers={"Content-Type": "application/json"})
        text = ""
        for ev in sse_events(conn.getresponse()):
            if ev != "[DONE]":
                text += ev["choices"][0]["text"]
        got["text"] = text
        conn.close()

    t = threading.Thread(target=stream)
    t.start()
    bad = ['{"prompt":', '{"prompt": "x", "n": 99}', '{"prompt": [1e9]}', "\xff\xfe",
           '{"model": "zzz", "prompt": "x"}', '{"prompt": "x", "max_tokens": 100000000}']
    for i in range(40):
        status, _, _ = server.request("POST", "/v1/completions", bad[i % len(bad)])
        assert status in (400, 404)
    t.join(60)
    assert got.get("text") == want


@pytest.fixture(scope="module")
def keyed_server():
    yield from _server_fixture("--api-key", "sekrit-42", "--served-model-name", "tiny-named")


def test_api_key(keyed_server):
    srv = keyed_server
    body = {"model": "tiny-named", "prompt": "x", "max_tokens": 1}
    for headers in [None, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit-42"},
                    {"Authorization": "Bearer sekrit-4"}]:
        e, _ = error_of(srv, "/v1/completions", body, 401, headers)
        assert e["code"] == "invalid_api_key"
    status, _, _ = srv.request("GET", "/v1/models")
    assert status == 401
    with pytest.raises(openai.AuthenticationError):
        srv.client(api_key="wrong").completions.create(model="tiny-named", prompt="x",
                                                       max_tokens=1)
    good = srv.client(api_key="sekrit-42")
    assert good.models.list().data[0].id == "tiny-named"
    r = good.completions.create(model="tiny-named", prompt="x", max_tokens=1)
    assert r.model == "tiny-named"
    # the folder name is not the served name any more
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    # open endpoints stay open
    assert srv.request("GET", "/health")[0] == 200
    assert srv.request("GET", "/metrics")[0] == 200
    assert srv.request("POST", "/tokenize", {"prompt": "hi"})[0] == 200


def test_queue_full_503():
    """One running sequence, a queue of one: a third request is refused with Retry-After.

    The running request is long, but a fast run (speculation emits several tokens a forward) can
    finish it before the third request arrives, which is then rightly admitted: such a round is
    run again, with a fresh pair. A server that never refuses fails every round."""
    srv = Server("--max-num-seqs", "1", "--max-queue", "1")
    try:
        long = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        for _ in range(5):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({**long, "stream": True}),
                         headers={"Content-Type": "application/json"})
            events = sse_events(conn.getresponse())
            next(events)  # running now
            waiting = threading.Thread(target=srv.request,
                                       args=("POST", "/v1/completions", {**long, "max_tokens": 2}))
            waiting.start()
            for _ in range(500):  # until the second one is queued
                if srv.metrics()["deltaserve:num_requests_waiting"] >= 1:
                    break
                threading.Event().wait(0.01)
            got, h, data = srv.request("POST", "/v1/completions", {"prompt": "y", "max_tokens": 1})
            conn.close()  # the long stream's client leaves: its request is aborted
            waiting.join(60)
            assert not waiting.is_alive()
            if got == 200:  # the long request was already done: no queue to be full
                continue
            assert got == 503, (got, data[:300])
            e = json.loads(data)["error"]
            assert set(e) == {"message", "type", "param", "code"}
            assert e["type"] == "server_error" and e["code"] == "queue_full"
            assert int(h["retry-after"]) >= 1
            break
        else:
            pytest.fail("five rounds with a request running and one queued, and none refused")
        r = srv.client().completions.create(model=MODEL_NAME, prompt="z", max_tokens=1)
        assert r.usage.completion_tokens == 1
    finally:
        assert srv.stop() == 0
