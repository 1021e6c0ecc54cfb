"""gpt-oss's chat format (harmony) without a model: its real chat template (tests/chat_templates/gpt-oss.jinja) and a
vocabulary with o200k_harmony's special tokens (a GGUF written here, trained on inline text). The frame markers
reach the parser through the real detokenizer, the channels become reasoning, content and calls (streamed any way),
each dialect's reasoning effort reaches the template, past calls and thoughts render back, and the grammar forces a
call or an answer format on the channels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmd.server.validation import ApiError
from llmd.tools.families import ToolFormat, model_traits
from llmd.tools.parsers import OutputParser, Piece
from llmd.tools.plan import plan_chat
from llmd.tools.spec import ToolSpec, normalise_history, parse_tools
from engine_testing import make_engine, no_leaked_blocks  # noqa: F401  (autouse leak check)
from vocab_fixtures import write_byte_level_gguf

TEMPLATE = (Path(__file__).parent / "chat_templates" / "gpt-oss.jinja").read_text(encoding="utf-8")
# o200k_harmony's special tokens (the real ids differ; the names are what the template, parser and grammar use)
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
            "<|message|>", "<|call|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
FUNCTIONS = parse_tools([WEATHER, ADD])
NAMES = {f.name: f.parameters for f in FUNCTIONS}
HARMONY = model_traits("GptOssForCausalLM", TEMPLATE)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import Tokenizer

    path = write_byte_level_gguf(tmp_path_factory.mktemp("harmony") / "harmony.gguf", "gpt-4o", SPECIALS, [],
                                 bos="<|startoftext|>", eos="<|return|>", add_bos=False, template=TEMPLATE)
    return Tokenizer.from_gguf(read_gguf_metadata(path), path)


def ids_of(tok, *names: str) -> set[int]:
    return {tok.backend.token_to_id(n) for n in names}


# --- recognition and the vocabulary ------------------------------------------------------------------------------

def test_the_template_is_recognised_as_harmony():
    assert HARMONY.tools == ToolFormat("harmony", native=True)
    assert HARMONY.thinks and HARMONY.has_tools and HARMONY.effort
    qwen3 = model_traits("Qwen3ForCausalLM", (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text())
    assert qwen3.tools.name == "hermes" and not qwen3.effort


def test_markers_are_decoded_and_end_is_no_eos(tok, smollm2_gguf):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import IncrementalDetokenizer, Tokenizer

    # <|return|> and <|call|> end the generation; <|end|> ends a message only, though llama.cpp's end-of-turn list
    # (which a GGUF's tokens are matched against) names it
    assert ids_of(tok, "<|return|>", "<|call|>", "<|endoftext|>") <= tok.eos_token_ids
    assert tok.message_end_ids == ids_of(tok, "<|end|>") and not tok.message_end_ids & tok.eos_token_ids
    text = "<|startoftext|><|channel|>analysis<|message|>Think, then answer.<|end|><|start|>assistant"
    ids = tok.encode(text)
    assert ids_of(tok, "<|channel|>", "<|message|>", "<|end|>", "<|start|>") <= set(ids)
    shown = text.removeprefix("<|startoftext|>")  # the frame markers are shown, other special tokens are not
    assert tok.decode(ids) == shown
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == shown
    smol = Tokenizer.from_gguf(read_gguf_metadata(smollm2_gguf), smollm2_gguf)  # other vocabularies: as before
    assert not smol.shown_special_ids and not smol.message_end_ids and smol.hidden_ids == smol.special_ids


def test_the_engine_shows_the_markers_and_goes_on_past_end(tok, tiny_llama_loaded):
    """The tiny Llama's weights with the harmony vocabulary, its config naming <|end|> as its end: a grammar makes it
    write two messages; the engine's text keeps every marker and does not stop at <|end|>."""
    from dataclasses import replace

    from llmd.engine import FinishReason, SamplingParams, generate
    from llmd.engine.types import Constraint

    end = tok.backend.token_to_id("<|end|>")
    loaded = replace(tiny_llama_loaded, tokenizer=tok, config=replace(tiny_llama_loaded.config, eos_token_ids=[end]))
    engine = make_engine(loaded)
    assert end not in engine.eos_token_ids and ids_of(tok, "<|return|>", "<|call|>") <= engine.eos_token_ids
    two = Constraint("lark", 'start: <|channel|> "analysis" <|message|> "ok" <|end|> <|start|> "assistant" '
                             '<|channel|> "final" <|message|> "4"')
    prompt = tok.encode("<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    [result] = generate(engine, [prompt], SamplingParams(max_tokens=40, temperature=0.0, constraint=two))
    assert result.finish_reason is FinishReason.STOP
    assert result.text == "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>4"


# --- the parser, on what the engine's detokenizer gives ----------------------------------------------------------

def engine_pieces(tok, ignore_eos: bool = False):
    """The text deltas the engine produces for a scripted output: its tokens detokenized one by one (special ones
    skipped unless shown), up to an end-of-generation token, whose text is never emitted (with ignore_eos it is
    decoded like the others)."""
    from llmd.model.tokenizer import IncrementalDetokenizer

    def split(text: str) -> list[str]:
        detok, out = IncrementalDetokenizer(tok), []
        for i in tok.encode(text):
            if i in tok.eos_token_ids and not ignore_eos:
                break
            out.append(detok.push(i))
        return out + [detok.flush()]
    return split


def by_chars(text: str) -> list[str]:
    return list(text)


def whole(text: str) -> list[str]:
    return [text]


def parse(pieces: list[str], names=NAMES, stream_args: bool = False, cut: bool = False) -> Piece:
    parser = OutputParser(None, ToolFormat("harmony", True).parser(names, stream_args=stream_args))
    out = Piece()
    for p in pieces:
        out.add(parser.feed(p))
    return out.add(parser.finish(cut))


def summary(piece: Piece) -> tuple:
    return piece.content, piece.reasoning, [(c.name, c.arguments) for c in piece.calls]


CALL_PARIS = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
CASES = [
    # (scripted output after the prompt's `<|start|>assistant`, expected (content, reasoning, calls))
    ("<|channel|>analysis<|message|>Two plus two is four.<|end|><|start|>assistant<|channel|>final<|message|>"
     "It is **4**.<|return|>", ("It is **4**.", "Two plus two is four.", [])),
    ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant" + CALL_PARIS,
     ("", "Need the weather tool.", [("get_weather", {"city": "Paris"})])),
    # two calls (an output that goes on past <|call|>: ignore_eos), the recipient before the channel, as the template
    # writes past calls, then after it
    ('<|channel|>analysis<|message|>Both.<|end|><|start|>assistant to=functions.add<|channel|>commentary json'
     '<|message|>{"a": 1, "b": 2}<|call|><|start|>assistant' + CALL_PARIS,
     ("", "Both.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})])),
    # a preamble the user may see (commentary without a recipient), then a call
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant" + CALL_PARIS,
     ("Let me check.", "", [("get_weather", {"city": "Paris"})])),
    ("A model that ignores the format.", ("A model that ignores the format.", "", [])),
    ("as", ("as", "", [])),  # which might have begun "assistant<|channel|>..."
    # a call to a tool the request does not have, or whose body is no JSON object, is given back as text
    ('<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"path":"/"}<|call|>',
     ('{"path":"/"}', "", [])),
    ("<|channel|>commentary to=functions.add <|constrain|>json<|message|>not json<|call|>", ("not json", "", [])),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_channels_become_reasoning_content_and_calls_streamed_any_way(tok, text, expected):
    for pieces in (whole, by_chars, engine_pieces(tok, ignore_eos=True)):
        assert summary(parse(pieces(text))) == expected, pieces
    # the engine stops at the first <|call|> or <|return|>: the calls after it are the next turn's
    first_end = min((at for m in ("<|call|>", "<|return|>") if (at := text.find(m)) >= 0), default=len(text))
    stopped = summary(parse(engine_pieces(tok)(text)))
    assert stopped == summary(parse([text[:first_end]])) and stopped[2] == expected[2][:1]


def test_a_cut_call_is_dropped_and_a_repeated_call_ends_the_answer():
    cut = "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 1, \"b"
    assert summary(parse(by_chars(cut), cut=True)) == ("", "", [])
    add = '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":1,"b":2}<|call|>'
    other = add.replace('"a":1', '"a":5')
    parser = OutputParser(None, ToolFormat("harmony", True).parser(NAMES))
    out = Piece()
    for p in by_chars(add[len("<|start|>assistant"):] + other + add + "<|start|>assistant<|channel|>final"):
        out.add(parser.feed(p))
        if parser.ended:
            break
    assert parser.ended and [c.arguments for c in out.add(parser.finish()).calls] == [{"a": 1, "b": 2},
                                                                                      {"a": 5, "b": 2}]


def test_a_grammar_kept_call_streams_its_arguments_as_written():
    text = "<|channel|>analysis<|message|>x<|end|><|start|>assistant" + CALL_PARIS.removesuffix("<|call|>")
    pieces = by_chars(text)
    out = parse(pieces, stream_args=True)
    call = out.calls[0]
    assert call.streamed and out.deltas[0].name == "get_weather" and out.deltas[0].id == call.id
    assert "".join(d.arguments for d in out.deltas) == '{"city":"Paris"}' and len(out.deltas) > 10
    assert not out.content


# --- the renderers: whole and streamed answers agree ---------------------------------------------------------------

def test_openai_and_ollama_answers_whole_and_streamed(tok):
    from types import SimpleNamespace

    from llmd.engine.types import FinishReason, RequestOutput, SamplingParams
    from llmd.server import ollama, openai
    from llmd.server.core import Generation, GenerationResult, ServerState
    from llmd.server.intake import Intake

    script = CASES[1][0]

    def generation():
        gen = Generation(ServerState(), None, SimpleNamespace(tokenizer=tok), [1, 2], SamplingParams())
        gen.output = OutputParser(None, ToolFormat("harmony", True).parser(NAMES))
        gen.finished, gen.finish_reason = True, "stop"
        return gen

    intake = Intake("m", None, SamplingParams(), True)
    gen = generation()
    res = GenerationResult(script, [7], "stop", None, [], gen.output.parse(script.removesuffix("<|call|>")))
    whole_ = openai.ChatAnswer(intake, "m").whole(gen, res)["choices"][0]
    assert whole_["message"]["reasoning_content"] == "Need the weather tool." and whole_["message"]["content"] is None
    assert json.loads(whole_["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert whole_["finish_reason"] == "tool_calls"
    for answer in (openai.ChatAnswer(intake, "m"), ollama.ChatAnswer("m")):
        gen = generation()
        events, pieces = [], engine_pieces(tok)(script)
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            piece = gen.output.feed(text)
            if last:
                piece.add(gen.output.finish())
            out = RequestOutput("r", [7], text, finished=last, finish_reason=FinishReason.STOP if last else None)
            events += answer.events(gen, out, piece)
        if isinstance(answer, openai.ChatAnswer):
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather tool."
            assert not "".join(d.get("content") or "" for d in deltas)
            args = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
            assert json.loads(args) == {"city": "Paris"}
            assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        else:
            messages = [e["message"] for e in events]
            assert "".join(m.get("thinking", "") for m in messages) == "Need the weather tool."
            assert [c["function"] for m in messages for c in m.get("tool_calls", [])] == [
                {"name": "get_weather", "arguments": {"city": "Paris"}}]
            assert not "".join(m["content"] for m in messages) and events[-1]["done"]


# --- prompts: effort from every dialect, and the history ------------------------------------------------------------

def render(tok, prompt, answer=None) -> str:
    plan = plan_chat(prompt.messages, prompt.tools, answer, prompt.think, prompt.template_kwargs, HARMONY,
                     prompt.effort)
    return tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)


def intake_of(route: str, extra: dict):
    from llmd.server import anthropic, ollama, openai, responses_api
    from llmd.server.core import ServerState
    from llmd.server.response_store import ResponseStore

    state = ServerState(model_name="gpt-oss")
    msgs = [{"role": "user", "content": "hi"}]
    if route == "openai":
        return openai.parse_chat({"model": "gpt-oss", "messages": msgs, **extra}, state)
    if route == "responses":
        return responses_api.parse({"model": "gpt-oss", "input": "hi", **extra}, state, ResponseStore())[0]
    if route == "anthropic":
        return anthropic.parse({"model": "gpt-oss", "messages": msgs, "max_tokens": 64, **extra}, state)[0]
    if route == "ollama-generate":
        return ollama.parse_generate({"model": "gpt-oss", "prompt": "hi", **extra}, state)
    return ollama.parse_chat({"model": "gpt-oss", "messages": msgs, **extra}, state)


EFFORTS = [
    ("openai", {}, "medium"),  # none asked: the template's default
    ("openai", {"reasoning_effort": "high"}, "high"),
    ("openai", {"reasoning_effort": "none"}, "low"),  # gpt-oss cannot stop thinking: its least
    ("openai", {"reasoning_effort": "xhigh"}, "high"),
    ("openai", {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "high"),
    ("responses", {"reasoning": {"effort": "low"}}, "low"),
    ("responses", {"reasoning": {"effort": "minimal", "summary": "auto"}}, "low"),
    ("ollama", {"think": "high"}, "high"),
    ("ollama-generate", {"think": "low"}, "low"),
    ("ollama", {"think": True}, "medium"),  # Ollama: true and false change nothing for gpt-oss
    ("ollama", {"think": False}, "medium"),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 10000}}, "medium"),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 31999}}, "high"),
    ("anthropic", {"thinking": {"type": "disabled"}}, "low"),
    ("anthropic", {"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}, "high"),
]


@pytest.mark.parametrize("route, extra, level", EFFORTS)
def test_each_dialects_effort_reaches_the_template(tok, route, extra, level):
    text = render(tok, intake_of(route, extra).prompt)
    assert f"\nReasoning: {level}\n" in text and text.count("Reasoning:") == 1
    assert text.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")


@pytest.mark.parametrize("route, extra, field", [
    ("openai", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("openai", {"chat_template_kwargs": {"reasoning_effort": "max"}}, "chat_template_kwargs.reasoning_effort"),
    ("responses", {"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ("ollama", {"think": "max"}, "think"),
    ("ollama-generate", {"think": 3}, "think"),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ("anthropic", {"output_config": {"effort": "extreme"}}, "output_config.effort"),
])
def test_a_bad_effort_is_a_400_naming_the_field(route, extra, field):
    with pytest.raises(ApiError) as err:
        intake_of(route, extra)
    assert err.value.status == 400 and err.value.param == field


def test_history_with_thoughts_calls_and_results_renders_back(tok):
    """Two calls in one turn (OpenAI's shape, results in the other order) become one call per turn, each followed
    by its result; the turn's reasoning goes with the first call; after a later answer the template drops it."""
    raw = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris, and 1+2?"},
           {"role": "assistant", "content": None, "reasoning_content": "Two tools.", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
               {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
           {"role": "tool", "tool_call_id": "c2", "content": "3"},
           {"role": "tool", "tool_call_id": "c1", "content": "22 C"}]
    msgs = normalise_history(raw, [{"role": m["role"], "content": m["content"] or ""} for m in raw])
    assert msgs[2]["thinking"] == "Two tools."
    plan = plan_chat(msgs, ToolSpec(FUNCTIONS), None, None, {}, HARMONY)
    text = tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)
    turns = text.split("<|start|>")
    assert turns[-6:] == [
        "assistant<|channel|>analysis<|message|>Two tools.<|end|>",
        'assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        'functions.get_weather to=assistant<|channel|>commentary<|message|>"22 C"<|end|>',
        'assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>',
        'functions.add to=assistant<|channel|>commentary<|message|>"3"<|end|>',
        "assistant"]
    assert "# Instructions\n\nBe brief." in text and "type get_weather = (_: {" in text
    # Ollama's shape: no ids, the thought as `thinking`; a later answer drops the thought, as the template does
    ollama_raw = [raw[1], {"role": "assistant", "content": "", "thinking": "One tool.", "tool_calls": [
        {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}, {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "It is 3."}, {"role": "user", "content": "Thanks"}]
    msgs = normalise_history(ollama_raw, [{"role": m["role"], "content": m["content"]} for m in ollama_raw])
    plan = plan_chat(msgs, ToolSpec(FUNCTIONS), None, None, {}, HARMONY)
    text = tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)
    assert "One tool." not in text and '<|message|>"3"<|end|>' in text
    assert "<|start|>assistant<|channel|>final<|message|>It is 3.<|end|>" in text


def test_thoughts_of_anthropic_and_responses_histories_go_with_their_calls(tok):
    from llmd.server import anthropic, responses_api

    body = {"messages": [{"role": "user", "content": "1+2?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "Use add.", "signature": "s"},
                             {"type": "redacted_thinking", "data": "x"},
                             {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}]}
    conv = responses_api.history({"input": [
        {"role": "user", "content": "1+2?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use add."}]},
        {"type": "function_call", "call_id": "t1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "t1", "output": "3"}]})
    for msgs in (anthropic.history(body), conv):
        assert msgs[1]["thinking"] == "Use add."
        plan = plan_chat(msgs, ToolSpec(FUNCTIONS), None, None, {}, HARMONY)
        text = tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)
        assert ("<|start|>assistant<|channel|>analysis<|message|>Use add.<|end|><|start|>assistant to=functions.add"
                in text)
    stored = responses_api.answer_turns([
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Use add."}]},
        {"type": "function_call", "call_id": "t1", "name": "add", "arguments": '{"a":1,"b":2}'}])
    assert stored[0]["thinking"] == "Use add." and stored[0]["tool_calls"][0]["function"]["name"] == "add"


# --- grammars, run through llguidance with the harmony vocabulary -------------------------------------------------

@pytest.fixture(scope="module")
def accepts(tok):
    import llguidance

    from llmd.engine.grammar import grammar_source, lltokenizer

    ll = lltokenizer(tok, tok.vocab_size, sorted(tok.eos_token_ids))

    def check(constraint, text: str, then_eos: bool = False) -> bool:
        m = llguidance.LLMatcher(ll, grammar_source(constraint), log_level=0)
        assert not m.is_error(), m.get_error()
        ids = tok.encode(text) + ([tok.backend.token_to_id("<|call|>")] if then_eos else [])
        return m.consume_tokens(ids) and m.is_accepting()
    return check


def plan_output(tok, choice: str, answer=None, think=None):
    plan = plan_chat([{"role": "user", "content": "hi"}], ToolSpec(FUNCTIONS, choice), answer, think, {}, HARMONY)
    return plan.output(tok.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs))


THOUGHT = "<|channel|>analysis<|message|>The user wants {any} thing.\nOK.<|end|><|start|>assistant"
CALL_ADD = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":1,"b":2}'


def test_required_and_named_choices_force_one_commentary_call(tok, accepts):
    required, parser = plan_output(tok, "required")
    assert required.kind == "lark" and parser.tools.stream_args
    assert accepts(required, THOUGHT + CALL_ADD) and accepts(required, CALL_ADD)
    assert accepts(required, THOUGHT + CALL_ADD, then_eos=True)  # <|call|> ends it
    assert not accepts(required, THOUGHT + "<|channel|>final<|message|>3")
    assert not accepts(required, CALL_ADD.replace('"b":2', '"b":"two"'))
    assert not accepts(required, CALL_ADD + "<|end|><|start|>assistant" + CALL_ADD)  # one call: <|call|> ends a turn
    named, _ = plan_output(tok, "get_weather")
    paris = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    assert accepts(named, THOUGHT + paris) and not accepts(named, THOUGHT + CALL_ADD)
    # what the grammar writes, the parser reads as the call (streamed: the grammar keeps it valid)
    assert summary(parse(engine_pieces(tok)(THOUGHT + paris), stream_args=True)) == (
        "", "The user wants {any} thing.\nOK.", [("get_weather", {"city": "Paris"})])
    auto, parser = plan_output(tok, "auto")  # the model chooses: no grammar, calls come whole
    assert auto is None and not parser.tools.stream_args


def test_an_answer_format_constrains_the_final_channel_only(tok, accepts):
    from llmd.tools.spec import AnswerFormat

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = AnswerFormat("json_schema", json.dumps(schema), "response_format")
    constraint, _ = plan_output(tok, "none", fmt)
    final = '<|channel|>final<|message|>{"city":"Oslo"}'
    assert accepts(constraint, THOUGHT + final) and accepts(constraint, final)
    assert not accepts(constraint, THOUGHT + "<|channel|>final<|message|>Oslo")
    # with tools under auto the answer format shuts free text out: a call or the formatted answer
    either, _ = plan_output(tok, "auto", fmt)
    assert accepts(either, THOUGHT + final) and accepts(either, THOUGHT + CALL_ADD)
    assert not accepts(either, THOUGHT + "<|channel|>final<|message|>hello")


# --- a real daemon: a tiny random-weight Qwen3 with the harmony vocabulary and gpt-oss's template -----------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    from llmd_daemon_proc import start_daemon
    from tiny_models import write_tiny_model

    base = tmp_path_factory.mktemp("llmd_harmony")
    folder = write_tiny_model(base / "tiny-harmony", "qwen3", seed=3)
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE,
                                                              "eos_token": "<|return|>"}))
    ends = [backend.token_to_id(t) for t in ("<|return|>", "<|call|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    d = start_daemon(base, "--model", str(folder))
    yield d
    assert d.stop() == 0, d.log()


@pytest.mark.slow
def test_a_forced_call_opens_with_the_markers_and_they_never_reach_the_answer(daemon):
    """The grammar makes the model open a message with <|channel|> (a special token); the engine's text keeps it, so
    the parser routes the thought (random weights write it to max_tokens) to each dialect's reasoning field, and no
    marker reaches any answer, whole or streamed. Ollama and /api/show see a thinking, tool-calling model."""
    import urllib.request

    import anthropic
    import openai

    model = daemon.stats()["model"]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=model, messages=ask, tools=[WEATHER], tool_choice="required", max_tokens=12, temperature=0,
                  reasoning_effort="low")
    whole_ = oai.chat.completions.create(**kwargs)
    message = whole_.choices[0].message
    assert message.reasoning_content and not message.content and not message.tool_calls
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == message.reasoning_content
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(daemon.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    ollama_ = post("/api/chat", {"model": model, "messages": ask, "tools": [WEATHER], "stream": False, "think": "high",
                                 "format": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
                                 "options": {"temperature": 0, "num_predict": 12}})
    assert ollama_["message"]["thinking"] and not ollama_["message"]["content"]
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    msg = claude.messages.create(model=model, max_tokens=12, messages=ask, tools=[tool], tool_choice={"type": "any"},
                                 thinking={"type": "enabled", "budget_tokens": 2048}, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking
    for answer in (whole_.model_dump_json(), json.dumps(ollama_), msg.model_dump_json()):
        assert "<|" not in answer
    caps = post("/api/show", {"model": model})["capabilities"]
    assert "thinking" in caps and "tools" in caps
