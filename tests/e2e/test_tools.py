"""Chat output parsing end to end (issue 34): reasoning_content / content / tool_calls through the
official openai client, streamed and not, and /v1/models' capabilities.

The bundled model (K3 chat format, thinking on by default) writes GSM-style text and never a
tool call or a closing think tag, so here: the thought of a length finish is all reasoning, a
request with tools gets a well-formed message that the client parses, and the stream (read with
the client's own stream helper) reassembles to exactly the non-streamed message. The tool-call
parsing itself is covered on hand-made outputs by tests/unit/test_text_toolparse.c and
test_server_oaiparse.c."""
import importlib.util
import json

from conftest import MODEL_NAME
from openai.lib.streaming.chat import ChatCompletionStreamState

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_models_capabilities(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200
    m = json.loads(body)["data"][0]
    assert m["object"] == "model" and m["id"] == MODEL_NAME  # OpenAI's fields stay
    caps = m["capabilities"]
    # structured outputs, and with them the enforced tool_choice values, need llguidance
    # (test_structured.py covers both cases)
    llg = importlib.util.find_spec("llguidance") is not None
    assert caps == {"chat_format": "k3", "tool_calls": True, "parallel_tool_calls": True,
                    "tool_choice": ["auto", "none"] + (["required", "function"] if llg else []),
                    "reasoning": True, "structured_outputs": llg}


def _whole_and_streamed(client, **kw):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, temperature=0,
                                           extra_body={"ignore_eos": True}, **kw)
    # the client's own stream accumulator (what chat.completions.stream uses; its final parse
    # refuses a length finish, so the snapshot is read instead)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MSGS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True},
                                                **kw):
        state.handle_chunk(chunk)
    return whole.choices[0], state.current_completion_snapshot.choices[0]


def _reasoning(msg):
    return (msg.model_extra or {}).get("reasoning_content")


def test_thought_without_end_is_reasoning(client):
    whole, streamed = _whole_and_streamed(client, max_tokens=12)
    assert whole.finish_reason == "length"
    # no </think> (K3: <|close|>think<|sep|>) came: everything is the thought
    assert whole.message.content is None
    assert isinstance(_reasoning(whole.message), str) and _reasoning(whole.message)
    assert "<|" not in _reasoning(whole.message)
    assert streamed.finish_reason == "length"
    assert (streamed.message.content or None) is None
    assert _reasoning(streamed.message) == _reasoning(whole.message)


def test_thinking_off_is_plain_text(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, temperature=0,
                                       max_tokens=12, extra_body={
                                           "ignore_eos": True,
                                           "chat_template_kwargs": {"thinking": False}})
    msg = r.choices[0].message
    assert isinstance(msg.content, str) and msg.content
    assert "reasoning_content" not in (msg.model_extra or {})
    assert msg.tool_calls is None


def test_tools_give_a_well_formed_message(client):
    for extra in ({}, {"tool_choice": "auto"}):
        whole, streamed = _whole_and_streamed(client, max_tokens=16, tools=TOOLS, **extra)
        assert whole.finish_reason in ("length", "stop", "tool_calls")
        assert whole.message.role == "assistant"
        for call in whole.message.tool_calls or []:
            assert call.type == "function" and call.id and call.function.name
            assert isinstance(call.function.arguments, str)
        assert streamed.finish_reason == whole.finish_reason
        assert (streamed.message.content or None) == whole.message.content
        assert _reasoning(streamed.message) == _reasoning(whole.message)
        assert (streamed.message.tool_calls or None) == (whole.message.tool_calls or None)
    # tool_choice none: the text as it is (here: the thought, which is still split out)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, temperature=0,
                                       max_tokens=8, tools=TOOLS, tool_choice="none",
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls is None
