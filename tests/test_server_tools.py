"""Structured output, tool calls and reasoning end to end: real `llmd serve` processes, real clients (openai with
pydantic parse(), ollama, curl). Two daemons: the bundled SmolLM2, whose template knows no tools (the generic
fallback), and a tiny random-weight Qwen3 with a Hermes-style template that renders tools and a <think> block.
Random weights can write anything, so every check is on what the grammar guarantees: the answer parses and
validates, calls name a tool and carry valid arguments."""

from __future__ import annotations

import json
import shutil
import subprocess

import aiohttp
import pytest
from tokenizers import AddedToken, Tokenizer

from llmd_daemon_proc import start_daemon

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]

# A Hermes / Qwen3-style template: tools in the system turn, calls as <tool_call> JSON, results as <tool_response>,
# and Qwen3's switch: enable_thinking false closes an empty thought in the prompt.
HERMES_THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    "</tools>\nFor each call return <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")


# Llama 3.x JSON tool calling: {"name": ..., "parameters": ...} as the whole answer, results in the ipython role.
LLAMA3_TOOLS_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nAnswer a function call as JSON: "
    "{\"name\": function name, \"parameters\": its arguments}.\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}"
    "<|eot_id|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{%- endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_tools_smol"))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def tiny(tiny_qwen3, tmp_path_factory):
    base = tmp_path_factory.mktemp("llmd_tools_tiny")
    folder = base / "tiny-hermes"
    shutil.copytree(tiny_qwen3, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = HERMES_THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    d = start_daemon(base, "--model", str(folder))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def tiny_llama3_tools(tiny_llama, tmp_path_factory):
    base = tmp_path_factory.mktemp("llmd_tools_llama3")
    folder = base / "tiny-llama3-tools"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = LLAMA3_TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    d = start_daemon(base, "--model", str(folder))
    yield d
    assert d.stop() == 0, d.log()


def _client(daemon):
    import openai

    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")


def _server_errors(daemon) -> int:
    return sum(n for code, n in daemon.stats()["server"]["http_responses"].items() if code.startswith("5"))


# --- structured output -------------------------------------------------------------------------------------------

def test_openai_parse_with_a_pydantic_model(smol):
    import pydantic

    class Capital(pydantic.BaseModel):
        country: str
        capital: str
        population_millions: int

    client = _client(smol)
    resp = client.chat.completions.parse(
        model=smol.stats()["model"], messages=[{"role": "user", "content": "The capital of France?"}],
        response_format=Capital, max_tokens=60, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Capital)
    # streamed, the same greedy request gives the same JSON text
    with client.chat.completions.stream(model=smol.stats()["model"], response_format=Capital, max_tokens=60,
                                        temperature=0, messages=[{"role": "user",
                                                                  "content": "The capital of France?"}]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == choice.message.content


def test_json_object_and_completions_response_format(smol):
    client = _client(smol)
    resp = client.chat.completions.create(model=smol.stats()["model"], messages=[
        {"role": "user", "content": "Describe a cat as JSON."}], response_format={"type": "json_object"},
        max_tokens=40, temperature=0)
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert resp.choices[0].message.content.startswith("{")
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    done = client.completions.create(model=smol.stats()["model"], prompt="Is the sky blue? Answer:", max_tokens=20,
                                     temperature=0, extra_body={"response_format": {
                                         "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert json.loads(done.choices[0].text)["answer"] in ("yes", "no")


def test_ollama_format_schema_and_json(smol):
    import ollama

    client = ollama.Client(host=smol.url)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    resp = client.chat(model=smol.stats()["model"], messages=[{"role": "user", "content": "Weather in Paris?"}],
                       format=schema, options={"num_predict": 40, "temperature": 0})
    data = json.loads(resp.message.content)
    assert set(data) == {"city", "sunny"} and isinstance(data["sunny"], bool)
    gen = client.generate(model=smol.stats()["model"], prompt="A JSON object with a name:", format="json",
                          options={"num_predict": 30, "temperature": 0})
    assert gen.response.startswith("{")


def test_llamacpp_grammar_and_json_schema_with_curl(smol):
    grammar = 'root ::= ("yes" | "no") "."'
    out = subprocess.run(["curl", "-s", smol.url + "/completion", "-d", json.dumps(
        {"prompt": "Is Paris in France?", "grammar": grammar, "n_predict": 8, "temperature": 0})],
        capture_output=True, text=True, timeout=120)
    body = json.loads(out.stdout)
    assert body["content"] in ("yes.", "no."), body
    out = subprocess.run(["curl", "-s", smol.url + "/completion", "-d", json.dumps(
        {"prompt": "A number:", "json_schema": {"type": "integer", "minimum": 0, "maximum": 999}, "n_predict": 8,
         "temperature": 0})], capture_output=True, text=True, timeout=120)
    value = json.loads(json.loads(out.stdout)["content"])
    assert isinstance(value, int) and 0 <= value <= 999


# --- tools on a model without a tool template (generic fallback) -------------------------------------------------

def test_openai_tool_loop_on_the_generic_fallback(smol):
    client = _client(smol)
    model = smol.stats()["model"]
    # one call (parallel_tool_calls false): after it the grammar allows only the end
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo", "Rome")
    # the call and its result go back; the answer is text (tool_choice none) that knows the result
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees"}]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=30, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # auto: text or a call, never broken plain chat
    auto = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          tools=[WEATHER], max_tokens=20, temperature=0)
    message = auto.choices[0].message
    assert message.content or message.tool_calls


def test_openai_streamed_tool_call_sends_name_once_then_arguments(smol):
    client = _client(smol)
    chunks = list(client.chat.completions.create(
        model=smol.stats()["model"], messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    heads = [d for d in deltas if d.id]
    assert len(heads) == 1 and heads[0].type == "function" and heads[0].function.name == "get_weather"
    assert all(d.function.name is None for d in deltas if not d.id)
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args)["city"] in ("Paris", "Oslo", "Rome")
    assert len([d for d in deltas if not d.id and d.function.arguments]) > 1  # streamed as written, not at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_ollama_tools_and_tool_results(smol):
    import ollama

    client = ollama.Client(host=smol.url)
    model = smol.stats()["model"]
    resp = client.chat(model=model, messages=ASK, tools=[WEATHER], options={"num_predict": 60, "temperature": 0})
    for call in resp.message.tool_calls or []:  # auto: the model may answer in text instead
        assert call.function.name == "get_weather" and call.function.arguments["city"] in ("Paris", "Oslo", "Rome")
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 24 degrees", "tool_name": "get_weather"}]
    final = client.chat(model=model, messages=history, options={"num_predict": 20, "temperature": 0})
    assert final.message.content and final.done
    show = client.show(model)
    assert "tools" not in show.capabilities and "thinking" not in show.capabilities


# --- forced calls end cleanly: one call for a named tool, no repeats, no call markup in the content --------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}
TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in Oslo? Use the tool for each city."}]


def _no_markup(text: str | None) -> bool:
    return "<tool" not in (text or "") and "tool_call>" not in (text or "")


def test_forced_calls_end_cleanly_with_the_openai_client(smol):
    """parallel_tool_calls left at its default (true), as LangChain and LiteLLM send it: a named tool is one call
    (the grammar ends after it), `required` ends when the model stops or repeats a call, and generation stops
    there: far fewer tokens than max_tokens."""
    client = _client(smol)
    model = smol.stats()["model"]
    named = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                           max_tokens=200, temperature=0)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    one_call = named.usage.completion_tokens
    assert one_call < 40
    for ask in (ASK, TWO_CITIES):
        resp = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="required",
                                              max_tokens=200, temperature=0)
        choice = resp.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)["city"]) for c in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(set(calls)) == len(calls) and ("get_weather", "Paris") in calls
        # stopped at the first repeat (or the model's own end): at most one call's worth of tokens more
        assert resp.usage.completion_tokens <= (len(calls) + 1) * one_call + 2 < 200, resp.usage
    assert len(calls) == 2  # the two cities, each once
    # streamed: the same distinct calls, no content at all, finish_reason tool_calls
    chunks = list(client.chat.completions.create(model=model, messages=TWO_CITIES, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=200, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    heads = [tc.function.name for d in deltas for tc in d.tool_calls or [] if tc.id]
    assert heads == ["get_weather"] * len(calls) and not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # a call max_tokens cuts is dropped from the whole answer; streamed, its start may be out (finish_reason
    # "length" marks it incomplete); a cut marker after a complete call never reaches the content
    cut = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                         max_tokens=one_call - 8, temperature=0)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert _no_markup(cut.choices[0].message.content)
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=one_call + 3, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert _no_markup("".join(d.content or "" for d in deltas))
    assert [tc.function.name for d in deltas for tc in d.tool_calls or [] if tc.id] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert smol.wait_idle()["kv"]["blocks_used"] == 0  # the requests stopped early left no blocks behind


def test_ollama_calls_end_cleanly_and_a_cut_call_leaves_no_markup(smol):
    """Ollama has no tool_choice: under the generic fallback's grammar the model chooses a call here (its earlier
    call in the history shows it how); calls come whole, a cut one is dropped (done_reason length)."""
    import ollama

    client = ollama.Client(host=smol.url)
    model = smol.stats()["model"]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "user", "content": "Weather in Paris?"}]
    resp = client.chat(model=model, messages=history, tools=[WEATHER], options={"num_predict": 200, "temperature": 0})
    assert resp.done_reason == "stop" and resp.message.content == "" and resp.eval_count < 60
    assert [(c.function.name, c.function.arguments) for c in resp.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    parts = list(client.chat(model=model, messages=history, tools=[WEATHER], stream=True,
                             options={"num_predict": 200, "temperature": 0}))
    assert "".join(p.message.content for p in parts) == "" and parts[-1].done_reason == "stop"
    assert [c.function.arguments for p in parts for c in p.message.tool_calls or []] == [{"city": "Paris"}]
    # cut inside the arguments (whole), and inside the closing tag (streamed)
    for cut in (client.chat(model=model, messages=history, tools=[WEATHER],
                            options={"num_predict": 12, "temperature": 0}),
                *client.chat(model=model, messages=history, tools=[WEATHER], stream=True,
                             options={"num_predict": resp.eval_count - 2, "temperature": 0})):
        assert _no_markup(cut.message.content) and not cut.message.tool_calls
    assert cut.done and cut.done_reason == "length"


async def test_bad_tool_requests_are_400s_never_500s(smol):
    before = _server_errors(smol)
    bad = [({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name"),
           ({"messages": ASK + [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]},
            "messages[1].role"),
           ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
               "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
               "required": ["a"]}}}],
             "tool_choice": "required"}, "tools[0].function.parameters")]  # the request's check sees the schema
    async with aiohttp.ClientSession(smol.url) as http:
        for body, field in bad:
            async with http.post("/v1/chat/completions", json={**body, "max_tokens": 4}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == field, (body, err)
    assert _server_errors(smol) == before


# --- a native tool template and a thinking model (tiny random Qwen3, Hermes-style template) -----------------------
# Its small vocabulary spells the forced markers and JSON in many tokens: budgets are larger than the text suggests.

def test_native_template_required_call_and_capabilities(tiny):
    client = _client(tiny)
    model = tiny.stats()["model"]
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=1, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=120, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the model's own template rendered the tools: the prompt grew by their description
    assert resp.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris", "Oslo", "Rome")
    assert resp.choices[0].finish_reason == "tool_calls"
    import ollama

    caps = ollama.Client(host=tiny.url).show(model).capabilities
    assert "tools" in caps and "thinking" in caps


def test_reasoning_split_and_think_switch(tiny):
    import ollama

    client = _client(tiny)
    model = tiny.stats()["model"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    # thinking on: the grammar opens the thought and leaves it free; with few tokens it is all reasoning
    thought = client.chat.completions.create(model=model, messages=ASK, response_format=rf, max_tokens=6,
                                             temperature=0)
    message = thought.choices[0].message
    assert message.model_extra.get("reasoning_content") and not message.content
    # thinking off: the template closes an empty thought; the answer alone follows the schema
    answer = client.chat.completions.create(model=model, messages=ASK, response_format=rf, max_tokens=40,
                                            temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert json.loads(answer.choices[0].message.content) in ({"ok": True}, {"ok": False})
    assert not answer.choices[0].message.model_extra.get("reasoning_content")
    streamed = list(client.chat.completions.create(model=model, messages=ASK, response_format=rf, max_tokens=6,
                                                   temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    oc = ollama.Client(host=tiny.url)
    off = oc.chat(model=model, messages=ASK, think=False, format=schema, options={"num_predict": 40,
                                                                                   "temperature": 0})
    assert json.loads(off.message.content) in ({"ok": True}, {"ok": False}) and not off.message.thinking
    on = list(oc.chat(model=model, messages=ASK, think=True, format=schema, stream=True,
                      options={"num_predict": 6, "temperature": 0}))
    assert "".join(p.message.thinking or "" for p in on) and not "".join(p.message.content for p in on)


def test_llama3_json_calls_and_ipython_results(tiny_llama3_tools):
    client = _client(tiny_llama3_tools)
    model = tiny_llama3_tools.stats()["model"]
    resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris", "Oslo", "Rome")
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls


async def test_constrained_answers_are_the_same_alone_and_batched(smol):
    """Greedy constrained requests give the same text alone and in a batch with free and other constrained ones."""
    import asyncio

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    tool_body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
                 "max_tokens": 40, "temperature": 0}
    free = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24, "temperature": 0}

    async with aiohttp.ClientSession(smol.url) as http:
        async def ask(b):
            async with http.post("/v1/chat/completions", json=b) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["choices"][0]["message"]

        alone, alone_call = await ask(body), await ask(tool_body)
        batch = await asyncio.gather(*[ask(b) for b in [body, free, tool_body, body, free, tool_body, body]])
    assert json.loads(alone["content"])["city"]
    for got in batch[0::3]:
        assert got["content"] == alone["content"]
    for got in (batch[2], batch[5]):
        assert got["tool_calls"][0]["function"] == alone_call["tool_calls"][0]["function"]
