"""An agent loop through a real client library from PyPI (openai-agents, on its chat-completions
model): the agent must call a tool (tool_choice required, enforced by constrained decoding), the
SDK runs the tool and sends its result back, and the loop ends on the model's next message, which
(tool_choice reset to auto by the SDK) is text. Random weights cannot choose a tool on their own,
so the first call is enforced; what is tested is the protocol the SDK speaks (make deps installs
openai-agents)."""
import asyncio
from typing import Annotated

import pytest
from pydantic import Field

from conftest import MODEL_NAME

# Small integers: random weights would write digits until max_tokens in an unbounded one.
Small = Annotated[int, Field(ge=0, le=99)]


def test_agent_calls_tool_gets_result_and_ends(server):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI
    set_tracing_disabled(True)
    calls = []

    @function_tool
    def add(a: Small, b: Small) -> int:
        """Adds two integers."""
        calls.append((a, b))
        return a + b

    client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    agent = Agent(name="calc", instructions="Add numbers with the add tool.", tools=[add],
                  model=OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client),
                  # thinking off: random weights never close a thought, and the SDK takes a
                  # message with only reasoning as no answer
                  model_settings=ModelSettings(
                      tool_choice="required", max_tokens=160, temperature=0,
                      extra_body={"chat_template_kwargs": {"thinking": False}}))
    result = asyncio.run(Runner.run(agent, "What is 2 + 3?", max_turns=4))
    kinds = [type(i) for i in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem], kinds
    assert kinds[-1] is MessageOutputItem and ToolCallItem not in kinds[2:], kinds
    assert len(calls) == 1 and all(isinstance(x, int) for x in calls[0])
    assert result.new_items[1].output == sum(calls[0])  # the tool's own result went back
    assert len(result.raw_responses) == 2  # the call, then the answer after the tool's result
    assert isinstance(result.final_output, str)
