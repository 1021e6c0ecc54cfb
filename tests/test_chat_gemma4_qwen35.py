"""Gemma 4's and Qwen3.5's chat formats without a model: their real chat templates (tests/chat_templates/) and
vocabularies with their special tokens (GGUFs written here, trained on inline text). Each dialect's thinking switch
reaches the template, past thoughts, calls and results render back, the outputs (Gemma 4's thought channel and call
syntax, Qwen3.5's <think> and XML calls) become reasoning, content and calls however they are streamed, and a forced
call's grammar writes each family's own syntax. Then a real daemon serves a tiny random-weight model of each family
carrying its template, to the official clients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmd.tools import gemma4
from llmd.tools.families import ToolFormat, model_traits
from llmd.tools.parsers import Piece
from llmd.tools.plan import plan_chat
from llmd.tools.spec import ToolSpec, normalise_history, parse_tools
from vocab_fixtures import write_byte_level_gguf

TEMPLATES = Path(__file__).parent / "chat_templates"
GEMMA_TEMPLATE = (TEMPLATES / "gemma-4-it.jinja").read_text(encoding="utf-8")
QWEN_TEMPLATE = (TEMPLATES / "qwen3.5.jinja").read_text(encoding="utf-8")
GEMMA = model_traits("Gemma4ForConditionalGeneration", GEMMA_TEMPLATE)
QWEN = model_traits("Qwen3_5ForConditionalGeneration", QWEN_TEMPLATE)
# Gemma 4's control tokens (the real ids differ; the names are what the template, tokenizer, parser and grammar use)
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>",
                  "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def tool(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool", "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER = tool("get_weather", {"city": {"type": "string"}}, ["city"])
ADD = tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])
SEARCH = tool("search", {"query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
                         "filters": {"type": "object"}}, ["query"])
CITY = tool("city_weather", {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, ["city"])
FUNCTIONS = parse_tools([WEATHER, ADD, SEARCH, CITY])
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def gemma_tok(tmp_path_factory):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import Tokenizer

    path = write_byte_level_gguf(tmp_path_factory.mktemp("gemma4") / "gemma4.gguf", "gpt-4o", GEMMA_SPECIALS, [],
                                 bos="<bos>", eos="<turn|>", add_bos=False, template=GEMMA_TEMPLATE)
    return Tokenizer.from_gguf(read_gguf_metadata(path), path)


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import Tokenizer

    path = write_byte_level_gguf(tmp_path_factory.mktemp("qwen35") / "qwen35.gguf", "qwen2", QWEN_SPECIALS,
                                 QWEN_ADDED, bos=None, eos="<|im_end|>", add_bos=False, template=QWEN_TEMPLATE)
    return Tokenizer.from_gguf(read_gguf_metadata(path), path)


@pytest.fixture(scope="module")
def family(request, gemma_tok, qwen_tok):
    """(tokenizer, traits, the end-of-generation marker the scripts end with) of the family named by the param."""
    return {"gemma4": (gemma_tok, GEMMA, "<turn|>"), "qwen3.5": (qwen_tok, QWEN, "<|im_end|>")}[request.param]


def prompt_and_output(tok, traits, messages=ASK, choice="auto", think=None, answer=None, tools=FUNCTIONS):
    """The rendered prompt, and the constraint and parser of its answer (the server's path, tools.plan)."""
    spec = ToolSpec(tools, choice) if tools else None
    plan = plan_chat(messages, spec, answer, think, {}, traits)
    text = tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)
    return (text, *plan.output(text))


def engine_pieces(tok, text: str) -> list[str]:
    """The text deltas the engine produces for a scripted output: its tokens detokenized one by one (special ones
    skipped unless shown), up to an end-of-generation token, whose text is never emitted."""
    from llmd.model.tokenizer import IncrementalDetokenizer

    detok, out = IncrementalDetokenizer(tok), []
    for i in tok.encode(text):
        if i in tok.eos_token_ids:
            break
        out.append(detok.push(i))
    return out + [detok.flush()]


def parsed(parser, pieces: list[str], cut: bool = False) -> Piece:
    out = Piece()
    for p in pieces:
        out.add(parser.feed(p))
    return out.add(parser.finish(cut))


def summary(piece: Piece) -> tuple:
    return piece.content, piece.reasoning, [(c.name, c.arguments) for c in piece.calls]


# --- recognition and the vocabulary ------------------------------------------------------------------------------

def test_the_templates_are_recognised():
    assert GEMMA.tools == ToolFormat("gemma4", native=True) and GEMMA.has_tools and GEMMA.thinks
    assert GEMMA.think_tags == gemma4.THOUGHT_TAGS and not GEMMA.thinks_unasked  # Gemma 4 thinks when asked
    assert QWEN.tools == ToolFormat("qwen3_coder", native=True) and QWEN.has_tools and QWEN.thinks
    assert QWEN.think_tags == ("<think>", "</think>") and QWEN.thinks_unasked


def test_gemma4_markers_are_shown_and_its_calls_end_the_generation(gemma_tok, qwen_tok):
    from llmd.model.tokenizer import IncrementalDetokenizer

    ids = {t: gemma_tok.backend.token_to_id(t) for t in GEMMA_SPECIALS}
    # after its calls the model writes <|tool_response> to wait for the results: an end of generation, as <turn|>
    assert {ids["<|tool_response>"], ids["<turn|>"]} <= gemma_tok.eos_token_ids
    text = '<|turn>model\n<|channel>thought\nx<channel|><|tool_call>call:f{a:<|"|>b<|"|>}<tool_call|><|tool_response>'
    shown = text.replace("<|turn>", "").replace("<|tool_response>", "")  # the markers a parser reads are kept
    assert gemma_tok.decode(gemma_tok.encode(text)) == shown
    detok = IncrementalDetokenizer(gemma_tok)
    assert "".join(detok.push(i) for i in gemma_tok.encode(text)) + detok.flush() == shown
    assert not qwen_tok.shown_special_ids  # Qwen3.5's <think> and <tool_call> are plain added tokens
    assert qwen_tok.decode(qwen_tok.encode("<think>\nx\n</think>\n\n<tool_call>")) == "<think>\nx\n</think>\n\n<tool_call>"


# --- parsing what the models write, streamed any way --------------------------------------------------------------

GEMMA_CASES = [
    # (a script after a thinking prompt (enable_thinking), expected (content, reasoning, calls))
    ("<|channel>thought\nThe user greets me.<channel|>Hello! How can I help?",
     ("Hello! How can I help?", "The user greets me.", [])),
    ('<|channel>thought\nNeed the weather.\n<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
     ("", "Need the weather.\n", [("get_weather", {"city": "Paris"})])),
    # no thought; text, then two calls, one with every kind of value (strings may hold the syntax's own characters)
    ('I will look.<|tool_call>call:add{a:1,b:-2}<tool_call|><|tool_call>call:search{exact:true,filters:{since:null,'
     'tags:[<|"|>x<|"|>,<|"|>y, z<|"|>],w:0.5},limit:5,query:<|"|>a "b", {c}: d<|"|>}<tool_call|>',
     ("I will look.", "", [("add", {"a": 1, "b": -2}), ("search", {
         "exact": True, "filters": {"since": None, "tags": ["x", "y, z"], "w": 0.5}, "limit": 5,
         "query": 'a "b", {c}: d'})])),
    ("Paris.", ("Paris.", "", [])),
    ("<b>Paris</b>", ("<b>Paris</b>", "", [])),
    # a call to a tool the request does not have, or that does not parse, is given back as text
    ('<|tool_call>call:rm_rf{path:<|"|>/<|"|>}<tool_call|>', ('<|tool_call>call:rm_rf{path:<|"|>/<|"|>}<tool_call|>',
                                                              "", [])),
    ("<|tool_call>call:add{a:1,b:}<tool_call|>", ("<|tool_call>call:add{a:1,b:}<tool_call|>", "", [])),
]
QWEN_CASES = [
    # (a script after the default prompt, which opens <think>; expected (content, reasoning, calls))
    ("Need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "</function>\n</tool_call>", ("", "Need the weather.\n", [("get_weather", {"city": "Paris"})])),
    ("Two calls.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
     "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nNew York\n</parameter>\n</function>\n</tool_call>",
     ("Let me check.", "Two calls.\n", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "New York"})])),
    ("Easy.\n</think>\n\nParis is the capital.", ("Paris is the capital.", "Easy.\n", [])),
]


def by_chars(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize("family, text, expected", [("gemma4", *c) for c in GEMMA_CASES]
                         + [("qwen3.5", *c) for c in QWEN_CASES], indirect=["family"])
def test_outputs_become_reasoning_content_and_calls_streamed_any_way(family, text, expected):
    tok, traits, end = family
    think = True if traits is GEMMA else None  # Gemma 4 thinks when asked; Qwen3.5 unless told not to
    prompt, _, _ = prompt_and_output(tok, traits, think=think)
    assert prompt.endswith("<|turn>model\n" if traits is GEMMA else "<|im_start|>assistant\n<think>\n")
    for pieces in ([text], by_chars(text), engine_pieces(tok, text + end)):
        _, _, parser = prompt_and_output(tok, traits, think=think)
        assert summary(parsed(parser, pieces)) == expected, pieces


def test_gemma4_thought_after_tool_results_and_no_thought_when_off(gemma_tok):
    """After the results the prompt continues the model turn: with thinking on inside an opened thought channel,
    without it straight into the answer; off, the template closed an empty thought before the answer."""
    history = normalise_history(RAW_HISTORY["openai"], plain(RAW_HISTORY["openai"]))
    text, _, parser = prompt_and_output(gemma_tok, GEMMA, history, think=True)
    assert text.endswith("<tool_response|><|channel>thought\n")
    script = "It is sunny.<channel|>It is 22 C and sunny in Paris."
    expected = ("It is 22 C and sunny in Paris.", "It is sunny.", [])
    assert summary(parsed(parser, engine_pieces(gemma_tok, script + "<turn|>"))) == expected
    text, _, parser = prompt_and_output(gemma_tok, GEMMA, history)
    assert text.endswith("<tool_response|>") and parser.reasoning is None
    assert summary(parsed(parser, by_chars("22 C."))) == ("22 C.", "", [])
    text, _, parser = prompt_and_output(gemma_tok, GEMMA, think=False)
    assert text.endswith("<|turn>model\n<|channel>thought\n<channel|>") and parser.reasoning is None


def test_a_cut_call_is_dropped_and_a_repeated_call_ends_the_answer(gemma_tok):
    _, _, parser = prompt_and_output(gemma_tok, GEMMA)
    cut = '<|tool_call>call:get_weather{city:<|"|>Par'
    assert summary(parsed(parser, by_chars(cut), cut=True)) == ("", "", [])
    call = '<|tool_call>call:add{a:1,b:2}<tool_call|>'
    _, _, parser = prompt_and_output(gemma_tok, GEMMA)
    out = Piece()
    for p in by_chars(call + call.replace("a:1", "a:5") + call + "more"):
        out.add(parser.feed(p))
        if parser.ended:
            break
    assert parser.ended and [c.arguments for c in out.add(parser.finish()).calls] == [{"a": 1, "b": 2},
                                                                                      {"a": 5, "b": 2}]


def test_openai_and_ollama_answers_whole_and_streamed(gemma_tok):
    from types import SimpleNamespace

    from llmd.engine.types import FinishReason, RequestOutput, SamplingParams
    from llmd.server import ollama, openai
    from llmd.server.core import Generation, GenerationResult, ServerState
    from llmd.server.intake import Intake

    script = GEMMA_CASES[1][0]

    def generation():
        gen = Generation(ServerState(), None, SimpleNamespace(tokenizer=gemma_tok), [1, 2], SamplingParams())
        gen.output = prompt_and_output(gemma_tok, GEMMA, think=True)[2]
        gen.finished, gen.finish_reason = True, "stop"
        return gen

    intake = Intake("m", None, SamplingParams(), True)
    gen = generation()
    res = GenerationResult(script, [7], "stop", None, [], gen.output.parse(script))
    message = openai.ChatAnswer(intake, "m").whole(gen, res)["choices"][0]["message"]
    assert message["reasoning_content"] == "Need the weather.\n" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    for answer in (openai.ChatAnswer(intake, "m"), ollama.ChatAnswer("m")):
        gen = generation()
        events, pieces = [], engine_pieces(gemma_tok, script + "<|tool_response>")
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            piece = gen.output.feed(text)
            if last:
                piece.add(gen.output.finish())
            out = RequestOutput("r", [7], text, finished=last, finish_reason=FinishReason.STOP if last else None)
            events += answer.events(gen, out, piece)
        if isinstance(answer, openai.ChatAnswer):
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather.\n"
            assert not "".join(d.get("content") or "" for d in deltas)
            args = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
            assert json.loads(args) == {"city": "Paris"} and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        else:
            messages = [e["message"] for e in events]
            assert "".join(m.get("thinking", "") for m in messages) == "Need the weather.\n"
            assert [c["function"] for m in messages for c in m.get("tool_calls", [])] == [
                {"name": "get_weather", "arguments": {"city": "Paris"}}]
            assert not "".join(m["content"] for m in messages) and events[-1]["done"]


# --- prompts: each dialect's thinking switch, and the history -----------------------------------------------------

def intake_of(route: str, extra: dict):
    from llmd.server import anthropic, ollama, openai, responses_api
    from llmd.server.core import ServerState
    from llmd.server.response_store import ResponseStore

    state = ServerState(model_name="m")
    if route == "openai":
        return openai.parse_chat({"model": "m", "messages": ASK, **extra}, state)
    if route == "responses":
        return responses_api.parse({"model": "m", "input": ASK[0]["content"], **extra}, state, ResponseStore())[0]
    if route == "anthropic":
        return anthropic.parse({"model": "m", "messages": ASK, "max_tokens": 64, **extra}, state)[0]
    if route == "ollama-generate":
        return ollama.parse_generate({"model": "m", "prompt": ASK[0]["content"], **extra}, state)
    return ollama.parse_chat({"model": "m", "messages": ASK, **extra}, state)


SWITCHES = [  # (route, request fields, thinking: True, False or None for the template's default)
    ("openai", {}, None),
    ("openai", {"reasoning_effort": "high"}, True),
    ("openai", {"reasoning_effort": "none"}, False),
    ("openai", {"chat_template_kwargs": {"enable_thinking": True}}, True),
    ("openai", {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, False),
    ("responses", {"reasoning": {"effort": "low"}}, True),
    ("responses", {"reasoning": {"effort": "none"}}, False),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, True),
    ("anthropic", {"thinking": {"type": "disabled"}}, False),
    ("anthropic", {"thinking": {"type": "adaptive"}}, None),
    ("ollama", {"think": True}, True),
    ("ollama", {"think": False}, False),
    ("ollama-generate", {"think": True}, True),
]


@pytest.mark.parametrize("route, extra, on", SWITCHES)
def test_each_dialects_thinking_switch_reaches_the_template(gemma_tok, qwen_tok, route, extra, on):
    prompt = intake_of(route, extra).prompt
    texts = {}
    for name, tok, traits in (("gemma", gemma_tok, GEMMA), ("qwen", qwen_tok, QWEN)):
        plan = plan_chat(prompt.messages, prompt.tools, None, prompt.think, prompt.template_kwargs, traits,
                         prompt.effort)
        texts[name] = tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)
        constraint, parser = plan.output(texts[name])
        assert constraint is None and (parser.reasoning is not None) == (on is True or (on is None and traits is QWEN))
    gemma, qwen = texts["gemma"], texts["qwen"]
    if on:  # Gemma 4: <|think|> opens the system turn, the model opens its own thought channel
        assert gemma.startswith("<bos><|turn>system\n<|think|>\n") and gemma.endswith("<|turn>model\n")
    else:  # off, or Gemma 4's default: an empty thought channel, closed
        assert "<|think|>" not in gemma and gemma.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    # Qwen3.5 thinks unless told not to: the prompt opens <think>, or closes an empty one
    assert qwen.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if on is False else
                         "<|im_start|>assistant\n<think>\n")


def test_a_thought_the_template_closes_unless_asked_is_no_thought(qwen_tok):
    """Qwen3.5's small models (0.8B, 2B) think only when asked: their template closes an empty thought by default.
    What the prompt ends with decides, not the family."""
    small = QWEN_TEMPLATE.replace("enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
                                  "    {%- else %}\n        {{- '<think>\\n' }}",
                                  "enable_thinking is true %}\n        {{- '<think>\\n' }}\n    {%- else %}\n"
                                  "        {{- '<think>\\n\\n</think>\\n\\n' }}")
    assert small != QWEN_TEMPLATE
    tok = qwen_tok.with_chat_template(small)
    for think, thought in ((None, False), (False, False), (True, True)):
        text, _, parser = prompt_and_output(tok, QWEN, think=think)
        assert text.endswith("<think>\n") == thought and (parser.reasoning is not None) == thought


RAW_HISTORY = {  # one tool round with its reasoning, as each dialect sends it
    "openai": [ASK[0], {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"}],
    "ollama": [ASK[0], {"role": "assistant", "content": "", "thinking": "Use the tool.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "22 C"}],
}


def plain(raw: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"] or ""} for m in raw]


def dialect_history(dialect: str) -> list[dict]:
    from llmd.server import anthropic, responses_api

    if dialect in RAW_HISTORY:
        return normalise_history(RAW_HISTORY[dialect], plain(RAW_HISTORY[dialect]))
    if dialect == "anthropic":
        return anthropic.history({"messages": [ASK[0], {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "22 C"}]}]})
    return responses_api.history({"input": [ASK[0], {
        "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "t1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "t1", "output": "22 C"}]})


@pytest.mark.parametrize("dialect", ["openai", "ollama", "anthropic", "responses"])
def test_a_tool_round_renders_back_from_each_dialect(gemma_tok, qwen_tok, dialect):
    """The call in the family's own syntax after its reasoning, then the result; the answer goes on from there."""
    messages = dialect_history(dialect)
    text, _, _ = prompt_and_output(gemma_tok, GEMMA, messages)
    assert text.endswith('<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|channel>thought\nUse the tool.\n'
                         '<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                         '<|tool_response>response:get_weather{value:<|"|>22 C<|"|>}<tool_response|>')
    text, _, _ = prompt_and_output(qwen_tok, QWEN, messages)
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
                         "Use the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                         "</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
                         "22 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


# --- grammars, run through llguidance with each vocabulary --------------------------------------------------------

@pytest.fixture(scope="module")
def accepts():
    import llguidance

    from llmd.engine.grammar import grammar_source, lltokenizer

    lls = {}

    def check(tok, constraint, text: str) -> bool:
        key = id(tok)
        if key not in lls:
            lls[key] = lltokenizer(tok, tok.vocab_size, sorted(tok.eos_token_ids))
        m = llguidance.LLMatcher(lls[key], grammar_source(constraint), log_level=0)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(tok.encode(text)) and m.is_accepting()
    return check


def g4_call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


PARIS = g4_call("get_weather", 'city:<|"|>Paris<|"|>')


def test_gemma4_forced_calls_are_written_in_its_syntax(gemma_tok, accepts):
    text, required, parser = prompt_and_output(gemma_tok, GEMMA, choice="required")
    assert text.endswith("<channel|>") and required.kind == "lark"
    ok = [PARIS, PARIS + g4_call("add", "a:1,b:-2"),  # parallel calls, one after another
          g4_call("search", 'query:<|"|>x<|"|>'),  # optional parameters left out, the others in sorted order
          g4_call("search", 'exact:false,filters:{a:[1,<|"|>b<|"|>,null],c:{}},limit:3,query:<|"|>multi\nline<|"|>'),
          g4_call("search", 'limit:0,query:<|"|><|"|>')]
    for call in ok:
        assert accepts(gemma_tok, required, call), call
    bad = ["Paris.", '{"name": "get_weather", "arguments": {"city": "Paris"}}', g4_call("get_weather", ""),
           g4_call("add", "a:1"), g4_call("add", "b:2,a:1"), g4_call("add", 'a:<|"|>1<|"|>,b:2'),
           g4_call("search", 'query:<|"|>x<|"|>,limit:3'), g4_call("city_weather", 'city:<|"|>Berlin<|"|>'),
           g4_call("rm_rf", "")]
    for call in bad:
        assert not accepts(gemma_tok, required, call), call
    # what the grammar writes, the parser reads
    assert summary(parsed(parser, engine_pieces(gemma_tok, ok[1] + "<|tool_response>"))) == (
        "", "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": -2})])
    _, named, _ = prompt_and_output(gemma_tok, GEMMA, choice="city_weather")
    one = g4_call("city_weather", 'city:<|"|>Oslo<|"|>')
    assert accepts(gemma_tok, named, one) and not accepts(gemma_tok, named, one + one)
    assert not accepts(gemma_tok, named, PARIS)


def test_gemma4_thought_stays_free_and_optional(gemma_tok, accepts):
    _, required, _ = prompt_and_output(gemma_tok, GEMMA, choice="required", think=True)
    assert accepts(gemma_tok, required, PARIS)
    assert accepts(gemma_tok, required, "<|channel>thought\nAny {text}: <b>.\n<channel|>" + PARIS)
    assert not accepts(gemma_tok, required, "<|channel>thought\nNo call.<channel|>Paris.")
    history = normalise_history(RAW_HISTORY["openai"], plain(RAW_HISTORY["openai"]))
    _, opened, _ = prompt_and_output(gemma_tok, GEMMA, history, choice="required", think=True)
    assert accepts(gemma_tok, opened, "Again.<channel|>" + PARIS) and not accepts(gemma_tok, opened, PARIS)
    from llmd.tools.spec import AnswerFormat

    fmt = AnswerFormat("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                  "required": ["ok"]}), "response_format")
    _, either, _ = prompt_and_output(gemma_tok, GEMMA, answer=fmt)  # auto with a format: a call or the format
    assert accepts(gemma_tok, either, '{"ok":true}') and accepts(gemma_tok, either, PARIS)
    assert not accepts(gemma_tok, either, "Paris.")


def test_qwen35_forced_calls_are_its_xml(qwen_tok, accepts):
    text, required, parser = prompt_and_output(qwen_tok, QWEN, choice="required")
    assert text.endswith("<think>\n")  # the thought the prompt opened is closed before the call
    call = ("<tool_call>\n<function=city_weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>")
    assert accepts(qwen_tok, required, "Pick one.\n</think>\n\n" + call.format("Oslo"))
    assert not accepts(qwen_tok, required, "Pick one.\n</think>\n\n" + call.format("Berlin"))  # the enum holds
    assert not accepts(qwen_tok, required, call.format("Oslo"))
    assert summary(parsed(parser, engine_pieces(qwen_tok, "Pick.\n</think>\n\n" + call.format("Oslo")))) == (
        "", "Pick.\n", [("city_weather", {"city": "Oslo"})])
    _, off, _ = prompt_and_output(qwen_tok, QWEN, choice="required", think=False)
    assert accepts(qwen_tok, off, call.format("Paris")) and not accepts(qwen_tok, off, "x</think>" + call.format("Paris"))


# --- a real daemon: a tiny random-weight model of each family with its template -----------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    from llmd_daemon_proc import start_daemon
    from tiny_models import write_tiny_model

    base = tmp_path_factory.mktemp("llmd_chat_2026")

    def with_template(folder: Path, template: str, added: list[str], special: bool, eos: list[str]) -> Path:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokens = [AddedToken(t, special=special, normalized=False) for t in added]
        backend.add_special_tokens(tokens) if special else backend.add_tokens(tokens)
        backend.save(str(folder / "tokenizer.json"))
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template, "eos_token": eos[0]}))
        ids = [backend.token_to_id(t) for t in eos]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
        return folder

    gemma = with_template(write_tiny_model(base / "gemma4", "gemma4_dense", seed=5), GEMMA_TEMPLATE,
                          [t for t in GEMMA_SPECIALS if t not in ("<pad>", "<eos>", "<bos>")], True, ["<turn|>"])
    qwen = with_template(write_tiny_model(base / "qwen35", "qwen3_5", seed=5), QWEN_TEMPLATE, QWEN_ADDED, False,
                         ["<|im_end|>", "<|endoftext|>"])
    config = json.loads((qwen / "config.json").read_text())  # room for the template's long tool instructions
    (qwen / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    (base / "config" / "llmd").mkdir(parents=True)
    (base / "config" / "llmd" / "config.toml").write_text(
        f'[models.gemma4]\npath = "{gemma}"\n\n[models.qwen35]\npath = "{qwen}"\n')
    d = start_daemon(base, "--kv-cache-bytes", str(16 * 2**20))
    yield d
    assert d.stop() == 0, d.log()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemma4", "qwen35"])
def test_a_forced_call_in_every_dialect_then_its_result(daemon, model):
    """A grammar makes random weights call the tool in the family's own syntax (thinking off: the template closed
    the thought); the parser gives each official client the call, whole and streamed, and no marker reaches any
    answer. The call and its result then render back for the next turn."""
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=model, messages=ASK, tools=[CITY], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=160, temperature=0, reasoning_effort="none")
    whole = oai.chat.completions.create(**kwargs)
    assert whole.choices[0].message.tool_calls, whole
    [call] = whole.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "city_weather" and args["city"] in ("Paris", "Oslo")
    assert whole.choices[0].finish_reason == "tool_calls" and not whole.choices[0].message.content
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    streamed = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    assert streamed[0].function.name == "city_weather"
    assert json.loads("".join(c.function.arguments or "" for c in streamed)) == args
    answers = [whole.model_dump_json(), *(c.model_dump_json() for c in chunks)]

    forced = {"type": "function", "name": "city_weather", "parameters": CITY["function"]["parameters"]}
    response = oai.responses.create(model=model, input=ASK[0]["content"], tools=[forced], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=160, temperature=0,
                                    reasoning={"effort": "none"})
    [item] = response.output
    assert item.type == "function_call" and json.loads(item.arguments)["city"] in ("Paris", "Oslo")
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    msg = claude.messages.create(model=model, max_tokens=160, messages=ASK,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 tools=[{"name": "city_weather", "input_schema": CITY["function"]["parameters"]}],
                                 thinking={"type": "disabled"}, extra_body={"temperature": 0})
    [block] = msg.content
    assert block.type == "tool_use" and block.name == "city_weather" and block.input["city"] in ("Paris", "Oslo")
    answers += [response.model_dump_json(), msg.model_dump_json()]

    for text in answers:
        assert not any(m in text for m in ("<|tool_call>", "<|channel>", '<|"|>', "<tool_call>", "</think>")), text
    # the next turn: the call and its result in the history, the answer free (a few tokens of random text)
    history = [*ASK, whole.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
    after = oai.chat.completions.create(model=model, messages=history, tools=[CITY], max_tokens=4, temperature=0,
                                        reasoning_effort="none")
    assert after.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.slow
def test_thoughts_reach_the_reasoning_fields(daemon):
    """Qwen3.5 thinks unless told not to (its prompt opens <think>): random weights think to max_tokens, all of it
    reasoning; Ollama's think switches it off. Gemma 4 with thinking off answers without a thought."""
    import urllib.request

    import openai

    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    whole = oai.chat.completions.create(model="qwen35", messages=ASK, max_tokens=6, temperature=0)
    message = whole.choices[0].message
    assert message.reasoning_content and not message.content
    chunks = list(oai.chat.completions.create(model="qwen35", messages=ASK, max_tokens=6, temperature=0, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) == (
        message.reasoning_content)

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(daemon.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def ollama_chat(model: str, think: bool) -> dict:
        return post("/api/chat", {"model": model, "messages": ASK, "think": think, "stream": False,
                                  "options": {"temperature": 0, "num_predict": 6}})["message"]

    for model in ("qwen35", "gemma4"):
        answer = ollama_chat(model, think=False)
        assert answer["content"] and not answer.get("thinking")
        assert {"thinking", "tools"} <= set(post("/api/show", {"model": model})["capabilities"])
    assert ollama_chat("qwen35", think=True)["thinking"]
