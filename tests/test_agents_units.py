"""The agent APIs without a daemon: Anthropic and Responses bodies into the normalised history and ToolSpec the chat
dialects use (tools.spec), composed with the generic tool plan, errors naming the dialect's fields; and both
renderers on a scripted answer, streamed and whole."""

from __future__ import annotations

import json
import logging

import pytest

from llmd.server import anthropic, responses_api
from llmd.server.response_store import ResponseStore
from llmd.server.validation import ApiError
from llmd.tools.plan import generic_messages

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_anthropic_history_calls_results_and_thoughts():
    body = {"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris and Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "two calls", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "Rain"}]},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "Sun", "is_error": True},
                    {"type": "text", "text": "Summarise."}]}]}
    out = anthropic.history(body)
    assert out[0] == {"role": "system", "content": "Be brief.\nUse tools."}
    assert out[2]["content"] == "Checking." and [c["function"] for c in out[2]["tool_calls"]] == [
        {"name": "weather", "arguments": {"city": "Paris"}}, {"name": "weather", "arguments": {"city": "Oslo"}}]
    assert out[3] == {"role": "tool", "content": "Rain", "tool_call_id": "t2", "name": "weather"}
    assert out[4] == {"role": "tool", "content": "Error: Sun", "tool_call_id": "t1", "name": "weather"}
    assert out[5] == {"role": "user", "content": "Summarise."} and len(out) == 6
    # the generic fallback renders it for a template without tools: calls as tagged text, results as one user turn
    plain = generic_messages(out, None)
    assert "<tool_call>" in plain[2]["content"] and plain[3]["role"] == "user"
    assert plain[3]["content"].count("<tool_response>") == 2 and plain[4]["content"] == "Summarise."


def test_anthropic_tool_result_must_answer_the_turn_before():
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]}
    anthropic.history({"messages": [{"role": "user", "content": "go"}, call, result]})
    with pytest.raises(ApiError) as late:  # a user turn between the call and its result
        anthropic.history({"messages": [{"role": "user", "content": "go"}, call, {"role": "user", "content": "x"},
                                        result]})
    assert late.value.param == "messages[3].content[0].tool_use_id"


def test_anthropic_tools_and_tool_choice():
    tools = [{"name": "weather", "description": "d", "input_schema": SCHEMA},
             {"type": "custom", "name": "time", "input_schema": {"type": "object"}}]
    spec = anthropic.tool_spec({"tools": tools}, {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert [f.name for f in spec.functions] == ["weather", "time"] and spec.choice == "required"
    assert not spec.parallel and spec.functions[0].parameters == SCHEMA
    named = anthropic.tool_spec({"tools": tools}, {"tool_choice": {"type": "tool", "name": "time"}})
    assert named.choice == "time" and named.parallel
    assert anthropic.tool_spec({"tools": tools}, {}).choice == "auto"
    with pytest.raises(ApiError) as bad:
        anthropic.tool_spec({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, {})
    assert bad.value.param == "tools[0].input_schema" and bad.value.message.startswith("tools[0].input_schema")
    with pytest.raises(ApiError) as bad:
        anthropic.tool_spec({"tools": [{"name": "bad name!", "input_schema": SCHEMA}]}, {})
    assert bad.value.param == "tools[0].name"


def test_anthropic_thinking_switch():
    assert anthropic.thinking({}) == (None, True)
    assert anthropic.thinking({"thinking": {"type": "enabled", "budget_tokens": 2048}}) == (True, True)
    assert anthropic.thinking({"thinking": {"type": "disabled"}}) == (False, True)
    assert anthropic.thinking({"thinking": {"type": "adaptive", "display": "omitted"}}) == (None, False)
    with pytest.raises(ApiError) as bad:
        anthropic.thinking({"thinking": {"type": "enabled"}})
    assert bad.value.param == "thinking.budget_tokens"


def test_responses_history_items():
    body = {"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                      "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sun"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]}]}
    out = responses_api.history(body)
    assert [m["role"] for m in out] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert out[2]["content"] == "Weather in Paris?" and out[3]["content"] == "Checking."
    assert [c["id"] for c in out[3]["tool_calls"]] == ["c1", "c2"]
    assert out[3]["tool_calls"][1]["function"]["arguments"] == {"city": "Oslo"}
    assert out[5] == {"role": "tool", "content": "Rain", "tool_call_id": "c2", "name": "weather"}
    assert responses_api.history({"input": "hi"}) == [{"role": "user", "content": "hi"}]


def test_responses_tools_choice_and_format():
    tools = [{"type": "function", "name": "weather", "parameters": SCHEMA, "strict": True}]
    spec, namespaced = responses_api.tool_spec({"tools": tools, "tool_choice": {"type": "function",
                                                                                "name": "weather"}},
                                               {"parallel_tool_calls": False})
    assert spec.choice == "weather" and not spec.parallel and spec.functions[0].parameters == SCHEMA
    assert namespaced == {}
    with pytest.raises(ApiError) as bad:
        responses_api.tool_spec({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, {})
    assert bad.value.param == "tools[0].parameters"
    with pytest.raises(ApiError) as bad:
        responses_api.tool_spec({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, {})
    assert bad.value.param == "tool_choice"
    fmt = responses_api.answer_format({"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}})
    assert fmt.kind == "json_schema" and fmt.field == "text.format"
    assert responses_api.answer_format({"text": {"format": {"type": "text"}}}) is None
    assert responses_api.reasoning({"reasoning": {"effort": "none"}}) is False
    assert responses_api.reasoning({"reasoning": {"effort": "low", "summary": "auto"}}) is True
    assert responses_api.reasoning({"reasoning": {"summary": "auto"}}) is None


# Codex's tools: a namespace of MCP functions, its own function tools, and hosted tools it sends along
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "parameters": SCHEMA, "strict": False},
    {"type": "web_search", "external_web_access": False},
    {"type": "namespace", "name": "mcp__docs__", "description": "Docs server", "tools": [
        {"type": "function", "name": "search", "description": "Search the docs", "parameters": SCHEMA},
        {"type": "function", "name": "_fetch", "parameters": SCHEMA, "defer_loading": True},
        {"type": "custom", "name": "grep", "format": {"type": "text"}}]},
    {"type": "namespace", "name": "wiki", "description": "Wiki", "tools": [
        {"type": "function", "name": "search", "parameters": SCHEMA}]},
    {"type": "local_shell"}]


def test_responses_namespaces_flatten_as_codex_does_and_other_tools_are_left_out(caplog):
    with caplog.at_level(logging.WARNING, logger="llmd.server"):
        spec, namespaced = responses_api.tool_spec({"tools": CODEX_TOOLS}, {})
    assert [f.name for f in spec.functions] == ["shell", "mcp__docs__search", "mcp__docs__fetch", "wiki__search"]
    assert namespaced == {"mcp__docs__search": ("mcp__docs__", "search"), "mcp__docs__fetch": ("mcp__docs__", "_fetch"),
                          "wiki__search": ("wiki", "search")}
    assert spec.functions[1].description == "Search the docs" and spec.functions[1].parameters == SCHEMA
    (warning,) = [r.getMessage() for r in caplog.records]  # one line per request, naming every tool left out
    assert "web_search" in warning and "custom (in namespace mcp__docs__)" in warning and "local_shell" in warning

    def chosen(choice):
        return responses_api.tool_spec({"tools": CODEX_TOOLS, "tool_choice": choice}, {})[0].choice

    assert chosen({"type": "function", "name": "mcp__docs__fetch"}) == "mcp__docs__fetch"  # as the model sees it
    assert chosen({"type": "function", "name": "_fetch"}) == "mcp__docs__fetch"  # a bare name one namespace has
    assert chosen({"type": "function", "name": "search", "namespace": "wiki"}) == "wiki__search"
    with pytest.raises(ApiError) as bad:
        chosen({"type": "function", "name": "search"})
    assert bad.value.param == "tool_choice.name" and "several namespaces" in bad.value.message
    with pytest.raises(ApiError) as bad:
        responses_api.tool_spec({"tools": [{"type": "namespace", "name": "ns", "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "array"}}]}]}, {})
    assert bad.value.param == "tools[0].tools[0].parameters"
    with pytest.raises(ApiError) as bad:
        responses_api.tool_spec({"tools": [{"type": "namespace", "tools": []}]}, {})
    assert bad.value.param == "tools[0].name"


def test_responses_namespaced_calls_come_back_split_and_go_in_joined(smol_tokenizer):
    from llmd.server.intake import Intake

    namespaced = {"mcp__docs__search": ("mcp__docs__", "search")}
    script = '<tool_call>\n{"name": "mcp__docs__search", "arguments": {"city": "Paris"}}\n</tool_call>'
    gen = _generation(smol_tokenizer, frozenset({"mcp__docs__search"}))
    answer = responses_api.ResponseAnswer(Intake("m", None, None, False), {}, "m", namespaced=namespaced)
    (item,) = answer.whole(gen, _result(gen, script))["output"]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "search", "mcp__docs__")
    answer = responses_api.ResponseAnswer(Intake("m", None, None, True), {}, "m", namespaced=namespaced)
    gen = _generation(smol_tokenizer, frozenset({"mcp__docs__search"}))
    events = _stream(answer, gen, script)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["name"], i["namespace"]) for i in added] == [("search", "mcp__docs__")]
    assert [e["name"] for e in events if e["type"] == "response.function_call_arguments.done"] == ["search"]
    # the stored turn, and the call sent back by the client, are shown to the model under the joined name
    turn = responses_api.answer_turns([events[-1]["response"]["output"][0]])[0]
    assert turn["tool_calls"][0]["function"]["name"] == "mcp__docs__search"
    sent = {**item, "arguments": json.dumps({"city": "Paris"})}
    out = responses_api.history({"input": [{"role": "user", "content": "Docs?"}, sent,
                                           {"type": "function_call_output", "call_id": item["call_id"],
                                            "namespace": "mcp__docs__", "output": "Found"}]})
    assert out[1]["tool_calls"][0]["function"]["name"] == "mcp__docs__search"
    assert out[2] == {"role": "tool", "content": "Found", "tool_call_id": item["call_id"],
                      "name": "mcp__docs__search"}


def test_fields_with_no_effect_are_accepted_and_named_at_debug(caplog):
    from llmd.server.core import ServerState

    state = ServerState(model_name="m")
    claude_code = {"model": "m", "max_tokens": 32000, "stream": True, "metadata": {"user_id": "u"},
                   "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                   "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}, "mcp_servers": [],
                   "container": None, "cache_control": {"type": "ephemeral"},
                   "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                              "cache_control": {"type": "ephemeral"}}]}],
                   "tools": [{"name": "Bash", "input_schema": SCHEMA, "cache_control": {"type": "ephemeral"}}]}
    codex = {"model": "m", "input": "hi", "store": False, "include": ["reasoning.encrypted_content"],
             "prompt_cache_key": "s1", "client_metadata": {"x-codex": "1"}, "stream": True,
             "reasoning": {"effort": "medium", "summary": "auto"}}
    with caplog.at_level(logging.DEBUG, logger="llmd.server"):
        intake, shown = anthropic.parse(claude_code, state)
        r_intake, _, _ = responses_api.parse(codex, state, ResponseStore())
    assert intake.prompt.think is None and shown and intake.params.max_tokens == 32000
    assert r_intake.prompt.think is True and r_intake.prompt.think_hint  # a model without thinking ignores it
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert "/v1/messages: accepted with no effect here: metadata, context_management, mcp_servers, cache_control" \
        in lines
    assert "/v1/responses: accepted with no effect here: include, prompt_cache_key, client_metadata" in lines
    with pytest.raises(ApiError) as bad:  # what would silently change the answer is still refused
        anthropic.parse({**claude_code, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, state)
    assert bad.value.param == "mcp_servers"


# --- the renderers on a scripted answer: a thought, text and two calls, streamed in small pieces -----------------

SCRIPT = ('<think>two cities</think>\n\nChecking.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf_metadata(smollm2_gguf), smollm2_gguf)


def _generation(tokenizer, tools=frozenset({"weather"})):
    from types import SimpleNamespace

    from llmd.engine.types import SamplingParams
    from llmd.server.core import Generation, ServerState
    from llmd.tools.parsers import OutputParser, ReasoningSplit, TaggedParser

    gen = Generation(ServerState(), None, SimpleNamespace(tokenizer=tokenizer), [1, 2, 3], SamplingParams())
    gen.output = OutputParser(ReasoningSplit(), TaggedParser(tools))
    gen.finished, gen.finish_reason = True, "stop"
    return gen


def _result(gen, text: str, finish: str = "stop"):
    """A whole answer's GenerationResult, its text parsed by the generation's parser."""
    from llmd.server.core import GenerationResult

    return GenerationResult(text, [7] * 9, finish, None, [], gen.output.parse(text))


def _stream(answer, gen, text: str, step: int = 3) -> list:
    """The events of a streamed answer: its opening, then each output of `step` characters with its parsed text."""
    from llmd.engine.types import FinishReason, RequestOutput

    events = answer.opening(gen)
    chunks = [text[i:i + step] for i in range(0, len(text), step)]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        piece = gen.output.feed(chunk)
        if last:
            piece.add(gen.output.finish())
        out = RequestOutput("r", [7], chunk, finished=last, finish_reason=FinishReason.STOP if last else None)
        events += answer.events(gen, out, piece)
    return events


def test_anthropic_stream_rebuilds_the_whole_message(smol_tokenizer):
    from llmd.server.intake import Intake

    intake = Intake("m", None, None, True)
    gen = _generation(smol_tokenizer)
    whole = anthropic.MessageAnswer(intake, "m", True).whole(gen, _result(gen, SCRIPT))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole["content"][0]["thinking"] == "two cities" and whole["content"][1]["text"] == "Checking."
    assert [b["input"] for b in whole["content"][2:]] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert whole["stop_reason"] == "tool_use"
    answer, gen = anthropic.MessageAnswer(intake, "m", True), _generation(smol_tokenizer)
    events = _stream(answer, gen, SCRIPT)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    blocks: list[dict] = []  # the content as a client rebuilds it from the events
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, block = e["delta"], blocks[e["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[d["type"]]
            block[key] = block.get(key, "") + d[key if key != "partial" else "partial_json"]
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial"))
            block["id"] = "x"
    assert kinds.count("content_block_stop") == len(blocks) == 4
    expected = [dict(b, id="x") if b["type"] == "tool_use" else b for b in whole["content"]]
    assert blocks == expected and events[-2]["delta"]["stop_reason"] == "tool_use"


def test_responses_stream_rebuilds_the_whole_response(smol_tokenizer):
    from llmd.server.intake import Intake

    intake = Intake("m", None, None, True)
    gen = _generation(smol_tokenizer)
    whole = responses_api.ResponseAnswer(intake, {}, "m").whole(gen, _result(gen, SCRIPT))
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert whole["status"] == "completed" and whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    answer, gen = responses_api.ResponseAnswer(intake, {}, "m"), _generation(smol_tokenizer)
    events = _stream(answer, gen, SCRIPT)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [i["type"] for i in done] == ["reasoning", "message", "function_call", "function_call"]
    final = events[-1]["response"]["output"]

    def strip(items):  # ids are fresh per answer
        return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]

    assert strip(done) == strip(final) == strip(whole["output"])
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == done[2]["arguments"] + done[3]["arguments"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Checking." and done[0]["content"][0]["text"] == "two cities"


def test_response_store_is_bounded_oldest_first():
    from llmd.server.response_store import ResponseStore

    store = ResponseStore(max_responses=3, max_chars=2000)
    turn = [{"role": "user", "content": "x" * 100}]
    for i in range(5):
        store.put({"id": f"r{i}"}, turn)
    assert len(store) == 3 and store.get("r0") is None and store.get("r4").conversation == turn
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 1700}])  # past the characters: the oldest go
    assert [k for k in ("r2", "r3", "r4", "big") if store.get(k)] == ["r4", "big"] and store.chars <= 2000
    store.put({"id": "huge"}, [{"role": "user", "content": "z" * 5000}])  # larger than the store: not kept
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big") and store.get("big") is None
    assert store.chars == sum(s.chars for s in store._items.values())


def test_responses_continue_a_stored_conversation():
    previous = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {}}}]}]
    out = responses_api.history({"instructions": "Be brief.", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "Sun"}]}, previous)
    assert out[0]["role"] == "system" and out[1:3] == previous
    assert out[3] == {"role": "tool", "content": "Sun", "tool_call_id": "c1", "name": "weather"}
    turns = responses_api.answer_turns([
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\": \"Oslo\"}"}])
    assert turns == [{"role": "assistant", "content": "It is sunny.", "thinking": "hm", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}]


def test_anthropic_stop_reasons(smol_tokenizer):
    from dataclasses import replace

    from llmd.engine.types import SamplingParams
    from llmd.server.intake import Intake

    asked = SamplingParams(max_tokens=100, stop=["END"])

    def stop_reason(gen_params, finish, stop=None, text="Hello"):
        answer = anthropic.MessageAnswer(Intake("m", None, asked, False), "m", True)
        gen = _generation(smol_tokenizer)
        gen.params, gen.stop_reason = gen_params, stop
        whole = answer.whole(gen, _result(gen, text, finish))
        return whole["stop_reason"], whole["stop_sequence"]

    assert stop_reason(asked, "length") == ("max_tokens", None)
    # the context had room for fewer tokens than asked, and they ran out
    assert stop_reason(replace(asked, max_tokens=10), "length") == ("model_context_window_exceeded", None)
    assert stop_reason(asked, "stop", "END") == ("stop_sequence", "END")
    assert stop_reason(asked, "stop", 2) == ("end_turn", None)  # a stop token (EOS)
    assert stop_reason(asked, "stop", text=SCRIPT) == ("tool_use", None)
