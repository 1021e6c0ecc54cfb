"""The agent APIs end to end: Anthropic Messages through the official `anthropic` package and OpenAI Responses through
the official `openai` package, against a real `llmd serve` on the bundled SmolLM2 (whose template knows no tools:
the generic fallback, with forced calls made by the grammar). Greedy and short, so whole and streamed answers can be
compared exactly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import jsonschema
import pytest

from llmd_daemon_proc import start_daemon

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}
FN_WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": CITY}
ASK = "What is the weather in Paris? Use the tool."
GREEDY = {"temperature": 0}  # the current anthropic package sends sampling fields only as extra body


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_agents"), env={"LLMD_LOG_LEVEL": "debug"})
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def model(daemon):
    return daemon.stats()["model"]


@pytest.fixture(scope="module")
def claude(daemon):
    import anthropic

    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(daemon):
    import openai

    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


def server_errors(daemon) -> int:
    return sum(n for code, n in daemon.stats()["server"]["http_responses"].items() if code.startswith("5"))


# --- Anthropic Messages ------------------------------------------------------------------------------------------

def test_anthropic_whole_streamed_stop_sequence_and_count_tokens(daemon, claude, model):
    hello = [{"role": "user", "content": "Say hello to the world."}]
    whole = claude.messages.create(model=model, max_tokens=12, messages=hello, system="Be brief.", extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.stop_reason == "max_tokens"
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    usage = whole.usage
    assert usage.output_tokens == 12 and usage.input_tokens + usage.cache_read_input_tokens > 10
    # the raw event sequence, then the SDK's accumulated message: the same text as the whole answer
    events = list(claude.messages.create(model=model, max_tokens=12, messages=hello, system="Be brief.",
                                         extra_body=GREEDY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    with claude.messages.stream(model=model, max_tokens=12, messages=hello, system="Be brief.",
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    # a stop sequence from the greedy text ends it there
    word = whole.content[0].text.split()[2]
    cut = claude.messages.create(model=model, max_tokens=12, messages=hello, system="Be brief.",
                                 stop_sequences=[word], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert whole.content[0].text.startswith(cut.content[0].text) and word not in cut.content[0].text
    # count_tokens counts the prompt the generation read
    counted = claude.messages.count_tokens(model=model, messages=hello, system="Be brief.")
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    with_tools = claude.messages.count_tokens(model=model, messages=hello, system="Be brief.", tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens + 20  # the fallback describes the tools in the prompt


def test_anthropic_tool_loop_forced_through_the_grammar(daemon, claude, model):
    ask = [{"role": "user", "content": ASK}]
    first = claude.messages.create(model=model, max_tokens=60, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use", first
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo", "Rome") and use.id
    # the call and its result go back: the answer is text
    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": "Sunny, 24 degrees"}]}]}]
    final = claude.messages.create(model=model, max_tokens=16, messages=history, tools=[WEATHER],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    assert final.content[0].text
    # streamed, a named tool: tool_use block with id and name, then its input as JSON deltas, which the SDK's
    # stream helper accumulates into the block's input
    with claude.messages.stream(model=model, max_tokens=60, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == use.input
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts][-1] == "tool_use" and starts[-1].name == "get_weather" and starts[-1].id
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial)["city"] in ("Paris", "Oslo", "Rome")
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]


def test_forced_calls_end_cleanly_in_both_agent_apis(daemon, claude, oai, model):
    """Parallel calls allowed (both APIs' default): a named tool is one call, `any` / `required` end at the model's
    stop or its first repeated call, well before max_tokens; a call max_tokens cuts is dropped (stop_reason
    max_tokens, status incomplete) and no call markup reaches a text block."""
    ask = [{"role": "user", "content": ASK}]
    named = claude.messages.create(model=model, max_tokens=200, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert named.stop_reason == "tool_use" and [b.type for b in named.content] == ["tool_use"]
    one_call = named.usage.output_tokens
    anyone = claude.messages.create(model=model, max_tokens=200, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                    tool_choice={"type": "any"})
    inputs = [json.dumps(b.input) for b in anyone.content if b.type == "tool_use"]
    assert anyone.stop_reason == "tool_use" and inputs and len(set(inputs)) == len(inputs)
    assert anyone.usage.output_tokens <= (len(inputs) + 1) * one_call + 2 < 200
    cut = claude.messages.create(model=model, max_tokens=one_call - 8, messages=ask, tools=[WEATHER],
                                 extra_body=GREEDY, tool_choice={"type": "any"})
    assert cut.stop_reason == "max_tokens" and not [b for b in cut.content if b.type == "tool_use"]
    assert all("<tool" not in b.text for b in cut.content if b.type == "text")

    resp = oai.responses.create(model=model, input=ASK, tools=[FN_WEATHER], tool_choice="required",
                                max_output_tokens=200, temperature=0)
    calls = [i.arguments for i in resp.output if i.type == "function_call"]
    assert resp.status == "completed" and calls and len(set(calls)) == len(calls)
    assert [i.type for i in resp.output] == ["function_call"] * len(calls)
    assert resp.usage.output_tokens <= (len(calls) + 1) * one_call + 2 < 200
    events = list(oai.responses.create(model=model, input=ASK, tools=[FN_WEATHER], tool_choice="required",
                                       max_output_tokens=one_call + 3, temperature=0, stream=True))
    final = events[-1].response
    assert final.status == "incomplete" and [i.type for i in final.output] == ["function_call"]
    assert final.output[0].status == "completed" and not any(e.type.startswith("response.output_text")
                                                             for e in events)


def test_anthropic_errors_in_anthropic_shape(daemon, claude, model):
    import anthropic

    before = server_errors(daemon)
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "42"}]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].tool_use_id" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as thinking:
        claude.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert thinking.value.body["error"]["message"].startswith("thinking")
    assert server_errors(daemon) == before


# --- OpenAI Responses --------------------------------------------------------------------------------------------

def test_responses_whole_and_streamed(daemon, oai, model):
    whole = oai.responses.create(model=model, input="Say hello to the world.", instructions="Be brief.",
                                 max_output_tokens=12, temperature=0, metadata={"run": "t1"})
    assert whole.object == "response" and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.metadata == {"run": "t1"}
    assert [i.type for i in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 10
    events = list(oai.responses.create(model=model, input="Say hello to the world.", instructions="Be brief.",
                                       max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    # a short answer completes: the SDK's stream helper accumulates it
    with oai.responses.stream(model=model, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is the capital of France?"}]}], max_output_tokens=40,
            temperature=0) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and "Paris" in final.output_text


def test_responses_tool_loop_forced_through_the_grammar(daemon, oai, model):
    first = oai.responses.create(model=model, input=ASK, tools=[FN_WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and json.loads(call.arguments)["city"] in (
        "Paris", "Oslo", "Rome")
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees"}]
    final = oai.responses.create(model=model, input=items, tools=[FN_WEATHER], tool_choice="none",
                                 max_output_tokens=16, temperature=0)
    assert [i.type for i in final.output] == ["message"] and final.output_text
    events = list(oai.responses.create(model=model, input=ASK, tools=[FN_WEATHER], stream=True, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       parallel_tool_calls=False, max_output_tokens=60))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[-1].type == "function_call" and added[-1].name == "get_weather" and added[-1].arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args)["city"] in ("Paris", "Oslo", "Rome") and done[-1].arguments == args
    assert events[-1].type == "response.completed" and events[-1].response.output[-1].arguments == args


# --- thinking: a tiny random-weight Qwen3 with a Hermes-style template that knows <think> --------------------------

from test_server_tools import tiny  # noqa: E402,F401  (its daemon fixture)

OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


def test_thinking_blocks_and_reasoning_items(tiny):  # noqa: F811
    import anthropic
    import openai

    model = tiny.stats()["model"]
    claude = anthropic.Anthropic(base_url=tiny.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": ASK}]
    # thinking on with an answer format: the grammar opens the thought and leaves it free; 6 tokens are all thought
    fmt = {"format": {"type": "json_schema", "schema": OK_SCHEMA}}
    on = {"type": "enabled", "budget_tokens": 1024}
    msg = claude.messages.create(model=model, max_tokens=6, messages=ask, thinking=on, output_config=fmt,
                                 extra_body=GREEDY)
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking
    assert msg.stop_reason == "max_tokens"
    events = list(claude.messages.create(model=model, max_tokens=6, messages=ask, thinking=on, output_config=fmt,
                                         extra_body=GREEDY, stream=True))
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking"]
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta") == msg.content[0].thinking
    hidden = claude.messages.create(model=model, max_tokens=6, messages=ask, output_config=fmt, extra_body=GREEDY,
                                    thinking={**on, "display": "omitted"})
    assert [b.type for b in hidden.content] == ["thinking"] and hidden.content[0].thinking == ""
    # thinking off: the template closes an empty thought, the answer alone follows the schema
    # (random weights: the engine lets JSON hold some whitespace between tokens, so the answer gets room)
    off = claude.messages.create(model=model, max_tokens=120, messages=ask, thinking={"type": "disabled"},
                                 output_config=fmt, extra_body=GREEDY)
    assert [b.type for b in off.content] == ["text"] and json.loads(off.content[0].text) in ({"ok": True},
                                                                                              {"ok": False})
    # Responses: a reasoning item, whole and streamed; effort none turns thinking off
    oai = openai.OpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0)
    text = {"format": {"type": "json_schema", "name": "r", "schema": OK_SCHEMA}}
    r = oai.responses.create(model=model, input=ASK, reasoning={"effort": "medium"}, text=text, max_output_tokens=6,
                             temperature=0)
    assert [i.type for i in r.output] == ["reasoning"] and r.output[0].content[0].text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 6
    events = list(oai.responses.create(model=model, input=ASK, reasoning={"effort": "medium"}, text=text,
                                       max_output_tokens=6, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == r.output[0].content[0].text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning"] and done[0].content[0].text == r.output[0].content[0].text
    plain = oai.responses.create(model=model, input=ASK, reasoning={"effort": "none"}, text=text,
                                 max_output_tokens=120, temperature=0)
    assert [i.type for i in plain.output] == ["message"] and json.loads(plain.output_text) in ({"ok": True},
                                                                                                {"ok": False})


def test_structured_output_through_both_sdks(daemon, claude, oai, model):
    import pydantic

    class Capital(pydantic.BaseModel):
        country: str
        capital: str

    before = server_errors(daemon)
    question = "What is the capital of France? Answer as JSON."
    msg = claude.messages.parse(model=model, max_tokens=60, messages=[{"role": "user", "content": question}],
                                output_format=Capital, extra_body=GREEDY)
    assert msg.stop_reason == "end_turn" and isinstance(msg.parsed_output, Capital)
    resp = oai.responses.parse(model=model, input=question, text_format=Capital, max_output_tokens=60, temperature=0)
    assert resp.status == "completed" and isinstance(resp.output_parsed, Capital)
    # one prompt, one schema, greedy: both APIs answer the same
    assert resp.output_parsed == msg.parsed_output
    assert server_errors(daemon) == before
    assert daemon.wait_idle()["kv"]["blocks_used"] == 0  # every agent request gave its KV blocks back


async def test_a_client_leaving_an_agent_stream_aborts_it(daemon, model):
    before = daemon.stats()["server"]["aborts"].get("disconnect", 0)
    story = "Tell me a long story about a dragon."
    bodies = [("/v1/messages", {"model": model, "max_tokens": 200, "stream": True,
                                "messages": [{"role": "user", "content": story}]}),
              ("/v1/responses", {"model": model, "max_output_tokens": 200, "stream": True, "input": story})]
    async with aiohttp.ClientSession(daemon.url) as http:
        for path, body in bodies:
            resp = await http.post(path, json=body)
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            names = []
            async for line in resp.content:  # named events: an `event:` line before each `data:` line
                if line.startswith(b"event: "):
                    names.append(line[7:].strip().decode())
                if len(names) >= 5:
                    break
            resp.close()  # drop the connection mid-stream
            assert names[0] in ("message_start", "response.created"), names
            await asyncio.to_thread(daemon.wait_idle, 60)
    s = daemon.wait_idle(timeout=60)
    assert s["server"]["aborts"].get("disconnect", 0) - before == 2
    assert s["kv"]["blocks_used"] == 0


def test_responses_store_and_previous_response_id(daemon, oai, model):
    import openai

    first = oai.responses.create(model=model, input=ASK, tools=[FN_WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert first.store is True
    (call,) = [i for i in first.output if i.type == "function_call"]
    # the stored response continues with only the call's output: the same answer as sending everything again
    chained = oai.responses.create(model=model, previous_response_id=first.id, tools=[FN_WEATHER],
                                   tool_choice="none", max_output_tokens=16, temperature=0, input=[
                                       {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    full = oai.responses.create(model=model, tools=[FN_WEATHER], tool_choice="none", max_output_tokens=16,
                                temperature=0, store=False, input=[
                                    {"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert chained.previous_response_id == first.id and chained.output_text == full.output_text
    assert chained.usage.input_tokens == full.usage.input_tokens
    assert oai.responses.retrieve(chained.id).output_text == chained.output_text
    with pytest.raises(openai.NotFoundError):  # store false keeps nothing
        oai.responses.retrieve(full.id)
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as gone:
        oai.responses.create(model=model, previous_response_id=first.id, input="Again?", max_output_tokens=4)
    assert gone.value.body["param"] == "previous_response_id"


# --- what real agents send --------------------------------------------------------------------------------------

# tool schemas as zod writes them (client_schemas.json): z.record's propertyNames, the $schema header
ZOD = json.loads((Path(__file__).parent / "client_schemas.json").read_text())
CLAUDE_TOOLS = [
    {"name": "Bash", "description": "Run a shell command", "input_schema": ZOD["zod4_bash_draft7"]},
    {"name": "TodoWrite", "description": "Write the todo list", "input_schema": ZOD["zod4_todos"]},
    {"name": "Edit", "description": "Edit a file", "input_schema": ZOD["zod3_edit"],
     "cache_control": {"type": "ephemeral"}}]
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
         "fine-grained-tool-streaming-2025-05-14", "effort-2025-11-24"]
QUESTION = "What is the capital of France?"


def log_lines(daemon, text: str) -> list[str]:
    return [line for line in daemon.log().splitlines() if text in line]


def test_a_claude_code_request_streams_and_answers(daemon, claude, model):
    """Claude Code's request, through the SDK's beta client as it sends it: betas, context_management, adaptive
    thinking, output_config.effort, cache_control on system, message and tool blocks, metadata, a max_tokens
    ceiling, zod tool schemas. It streams the answer the plain request gets; a forced call validates."""
    ephemeral = {"type": "ephemeral"}
    plain = claude.messages.create(model=model, max_tokens=40, extra_body=GREEDY, tools=CLAUDE_TOOLS,
                                   system="You are a coding agent.",
                                   messages=[{"role": "user", "content": QUESTION}])
    agent = dict(
        model=model, max_tokens=32000, extra_body=GREEDY, betas=BETAS, tools=CLAUDE_TOOLS,
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        thinking={"type": "adaptive"}, output_config={"effort": "high"}, metadata={"user_id": "user_abc_session_1"},
        system=[{"type": "text", "text": "You are a coding agent.", "cache_control": ephemeral}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION, "cache_control": ephemeral}]}])
    with claude.beta.messages.stream(**agent) as stream:
        kinds = [e.type for e in stream]
        answer = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [(b.type, b.text) for b in answer.content] == [(b.type, b.text) for b in plain.content]
    assert answer.stop_reason == plain.stop_reason == "end_turn"
    # a forced call of the zod-schema tool: its input is what the schema allows
    with claude.beta.messages.stream(**{**agent, "max_tokens": 200, "messages": [
            {"role": "user", "content": "List the files here."}],
            "tool_choice": {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True}}) as stream:
        called = stream.get_final_message()
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert use.name == "Bash" and called.stop_reason == "tool_use"
    jsonschema.validate(use.input, ZOD["zod4_bash_draft7"])
    # the fields with no effect are named at DEBUG in the daemon's log
    assert log_lines(daemon, "/v1/messages: accepted with no effect here: metadata, context_management")


QUERY = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}}, "required": ["query"],
         "additionalProperties": False}
SHELL = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
         "required": ["command"], "additionalProperties": False}


def codex_tools(namespaced: bool) -> list[dict]:
    """Codex's tools: its shell, a hosted web search, and an MCP server's tools grouped in a namespace (namespaced
    False: the same functions as the flat tools the model sees, and no web search)."""
    search = {"type": "function", "name": "search", "description": "Search the docs", "strict": False,
              "parameters": QUERY}
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
             "parameters": SHELL}
    if not namespaced:
        return [shell, {**search, "name": "mcp__docs__search"}]
    return [shell, {"type": "web_search", "external_web_access": False},
            {"type": "namespace", "name": "mcp__docs__", "description": "Tools of the docs MCP server",
             "tools": [search]}]


def test_a_codex_request_answers_and_a_namespaced_call_comes_back_under_its_name(daemon, oai, model):
    """Codex's request (namespace + web_search + function tools, include, store false, prompt_cache_key,
    client_metadata, reasoning) answers as the plain request with the flattened functions does; a forced call of
    the namespaced function comes back with its own name and its namespace, as Codex routes it."""
    warned = len(log_lines(daemon, "tools left out (only function tools"))
    ask = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    plain = oai.responses.create(model=model, instructions="You are a coding agent.", input=ask, temperature=0,
                                 tools=codex_tools(False), max_output_tokens=40)
    agent = dict(model=model, instructions="You are a coding agent.", temperature=0, max_output_tokens=40,
                 tools=codex_tools(True), tool_choice="auto", parallel_tool_calls=False, store=False,
                 include=["reasoning.encrypted_content"], prompt_cache_key="session-1",
                 reasoning={"effort": "medium", "summary": "auto"},
                 extra_body={"client_metadata": {"x-codex-installation-id": "abc"}})
    events = list(oai.responses.create(**agent, input=ask, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == plain.output_text
    forced = list(oai.responses.create(**{**agent, "tool_choice": {"type": "function", "name": "mcp__docs__search"},
                                          "max_output_tokens": 60}, stream=True,
                                       input=[{"role": "user", "content": "Search the docs for streaming."}]))
    (call,) = [i for i in forced[-1].response.output if i.type == "function_call"]
    assert (call.name, call.namespace) == ("search", "mcp__docs__")
    jsonschema.validate(json.loads(call.arguments), QUERY)
    added = [e.item for e in forced if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [(i.name, i.namespace) for i in added] == [("search", "mcp__docs__")]
    # Codex sends the call back with its namespace: the conversation continues
    final = oai.responses.create(**agent, input=[
        {"role": "user", "content": "Search the docs for streaming."}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Streaming: use SSE."}])
    assert final.status in ("completed", "incomplete") and final.output
    # the hosted tool was left out with one warning per request, the fields with no effect named at DEBUG
    assert len(log_lines(daemon, "tools left out (only function tools")) == warned + 3
    assert log_lines(daemon, "/v1/responses: accepted with no effect here: include, prompt_cache_key, client_metadata")


def test_a_chat_completions_agent_request_answers_as_the_plain_one(daemon, oai, model):
    """The fields agents send to /v1/chat/completions with no meaning here change nothing."""
    ask = [{"role": "user", "content": QUESTION}]
    tools = [{"type": "function", "function": {"name": "mcp__docs__search", "parameters": QUERY, "strict": True}}]
    plain = oai.chat.completions.create(model=model, messages=ask, tools=tools, temperature=0, max_tokens=40)
    chunks = list(oai.chat.completions.create(
        model=model, messages=ask, tools=tools, temperature=0, max_completion_tokens=40, stream=True,
        stream_options={"include_usage": True}, parallel_tool_calls=False, store=False, metadata={"run": "1"},
        prediction={"type": "content", "content": "Paris"}, modalities=["text"], reasoning_effort="low",
        user="u", extra_body={"prompt_cache_key": "s1"}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    (line,) = log_lines(daemon, "/v1/chat/completions: accepted with no effect here: ")
    ignored = line.split("accepted with no effect here: ")[1].split(", ")
    assert sorted(ignored) == ["metadata", "modalities", "prediction", "prompt_cache_key", "store", "user"]


def test_every_error_line_in_the_log_says_why(daemon, claude, oai, model):
    """A 4xx/5xx request's line in the daemon's log carries the message the client got."""
    import anthropic
    import openai

    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]})
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=model, input="hi", tools=codex_tools(True),
                             tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                    functions=[{"name": "f", "parameters": QUERY}])
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    for line in ("POST /v1/messages 400 mcp_servers MCP servers are not supported",
                 "POST /v1/responses 400 tool_choice.name names no tool in tools: 'nope'",
                 "POST /v1/chat/completions 400 functions (the legacy form of tools) is not supported",
                 "GET /v1/models/no-such-model 404 "):
        assert log_lines(daemon, line), line
    assert all("INFO" in line for line in log_lines(daemon, " 400 "))
