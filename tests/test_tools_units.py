"""The server's tool-call, structured-output and reasoning parts without an engine: per-family parsers on scripted
outputs streamed piece by piece (character by character, and token by token with the bundled SmolLM2 tokenizer),
request checks, the chat plans, and the composed grammars run through llguidance with a real tokenizer."""

from __future__ import annotations

import json

import pytest

from llmd.server.validation import ApiError
from llmd.tools.families import ToolFormat, model_traits
from llmd.tools.grammar import answer_constraint, lark_grammar
from llmd.tools.parsers import OutputParser, Piece, ReasoningSplit
from llmd.tools.plan import generic_messages, plan_chat
from llmd.tools.spec import AnswerFormat, ToolSpec, normalise_history, parse_tool_choice, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
FUNCTIONS = parse_tools([WEATHER, ADD])
NAMES = frozenset({"get_weather", "add"})


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf):
    from llmd.model.gguf import read_gguf_metadata
    from llmd.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf_metadata(smollm2_gguf), path=smollm2_gguf)


def run_parser(make, text: str, pieces, cut: bool = False) -> Piece:
    parser = make()
    out = Piece()
    for p in pieces(text):
        out.add(parser.feed(p))
    return out.add(parser.finish(cut))


def by_chars(text):
    return list(text)


def whole(text):
    return [text]


def by_tokens(tok):
    def split(text):
        ids = tok.encode(text)
        return [tok.decode([i], skip_special_tokens=False) for i in ids]
    return split


def summary(piece: Piece) -> tuple:
    return piece.content, piece.reasoning, [(c.name, c.arguments) for c in piece.calls]


FAMILY_CASES = [
    # (format name, thinks, scripted output, expected (content, reasoning, calls))
    ("hermes", False, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     ("Let me check.", "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])),
    ("hermes", True, '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                     '"arguments": {"city": "Oslo"}}\n</tool_call>',
     ("", "\nThe user wants weather.\n", [("get_weather", {"city": "Oslo"})])),
    ("qwen3_coder", False, '<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n4\n'
                           '</parameter>\n</function>\n</tool_call>',
     ("", "", [("add", {"a": 3, "b": 4})])),
    ("llama3", False, '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     ("", "", [("get_weather", {"city": "Rome"})])),
    ("llama3", False, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 1}}; '
                      '{"name": "add", "parameters": {"a": 2, "b": 2}}',
     ("", "", [("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 2})])),
    ("llama3", False, "The capital of France is Paris.", ("The capital of France is Paris.", "", [])),
    ("mistral", False, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]',
     ("", "", [("add", {"a": 5, "b": 6})])),
    ("mistral", False, '[{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "add", "arguments": '
                       '{"a": 0, "b": 0}}]', ("", "", [("get_weather", {"city": "Lima"}), ("add", {"a": 0, "b": 0})])),
    ("mistral", False, 'get_weather[ARGS]{"city": "Kyiv"}', ("", "", [("get_weather", {"city": "Kyiv"})])),
    ("mistral", False, 'add[ARGS]{"a": 1, "b": 2}add[ARGS]{"a": 3, "b": 4}', ("", "", [("add", {"a": 1, "b": 2}),
                                                                                     ("add", {"a": 3, "b": 4})])),
    ("mistral", False, "adding numbers is easy", ("adding numbers is easy", "", [])),
    ("generic", False, "Hello! How can I help?", ("Hello! How can I help?", "", [])),
    ("generic", False, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     ("", "", [("add", {"a": 1, "b": 2})])),
]


@pytest.mark.parametrize("family, thinks, text, expected", FAMILY_CASES)
def test_family_parsers_streamed_any_way_give_the_same_calls(family, thinks, text, expected, smol_tokenizer):
    fmt = ToolFormat(family, native=family != "generic")

    def make():
        return OutputParser(ReasoningSplit() if thinks else None, fmt.parser(NAMES))

    for pieces in (whole, by_chars, by_tokens(smol_tokenizer)):
        assert summary(run_parser(make, text, pieces)) == expected, pieces


MALFORMED = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "hermes"),  # bad JSON
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "hermes"),  # names no tool
    ('<tool_call>{"name": "add", "arguments": "not an object"}</tool_call>', "hermes"),
    ('{"name": "add", "parameters": [1, 2]}', "llama3"),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', "mistral"),  # unfinished, but not cut: maybe text
]


@pytest.mark.parametrize("text, family", MALFORMED)
def test_malformed_calls_come_back_as_text(text, family):
    fmt = ToolFormat(family, native=True)
    for pieces in (whole, by_chars):
        out = run_parser(lambda: OutputParser(None, fmt.parser(NAMES)), text, pieces)
        assert out.calls == [] and out.content == text


ADD_1 = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
ADD_2 = '{"name": "add", "arguments": {"a": 3, "b": 4}}'


@pytest.mark.parametrize("family, text, cut, expected", [
    # a call the output ends inside of is dropped, whatever ended it
    ("hermes", '<tool_call>{"name": "add", "argu', False, ("", [])),
    # after a call, or when max_tokens cut the output, a start of the call marker is markup, not text
    ("generic", f"<tool_call>\n{ADD_1}\n</tool_call>\n<tool_call", False, ("", [{"a": 1, "b": 2}])),
    ("generic", "<tool_c", True, ("", [])),
    ("generic", "Hello <tool", True, ("Hello", [])),
    ("generic", "a <", False, ("a <", [])),  # not cut, no call: text as written
    ("mistral", f'[TOOL_CALLS][{ADD_1}, {{"name": "add", "argu', True, ("", [{"a": 1, "b": 2}])),
    ("llama3", '{"name": "add", "parameters": {"a": 1', True, ("", [])),
])
def test_cut_calls_and_call_markers_never_reach_the_content(family, text, cut, expected):
    fmt = ToolFormat(family, native=family != "generic")
    for pieces in (whole, by_chars):
        out = run_parser(lambda: OutputParser(None, fmt.parser(NAMES)), text, pieces, cut=cut)
        assert (out.content.strip(), [c.arguments for c in out.calls]) == expected, pieces


@pytest.mark.parametrize("family, head, tail", [
    ("hermes", f"<tool_call>\n{ADD_1}\n</tool_call>\n<tool_call>\n{ADD_2}\n</tool_call>\n"
               f"<tool_call>\n{ADD_1.replace(' ', '')}\n</tool_call>", f"\nmore text\n<tool_call>\n{ADD_2}"),
    ("llama3", f"{ADD_1}; {ADD_2}; {ADD_1}", "; more"),
    ("mistral", f"[TOOL_CALLS][{ADD_1}, {ADD_2}, {ADD_1}", f", {ADD_2}"),
])
def test_a_repeated_call_ends_the_answer_at_once(family, head, tail):
    """The same name and arguments again (however spaced): the calls before it are the answer, the parser says it
    ended as soon as the repeat is complete (the last character of `head`), and nothing after it comes out."""
    for pieces in (whole, by_chars):
        parser = OutputParser(None, ToolFormat(family, native=True).parser(NAMES))
        out, ended_at = Piece(), None
        for i, p in enumerate(pieces(head + tail)):
            out.add(parser.feed(p))
            if parser.ended and ended_at is None:
                ended_at = i
        out.add(parser.finish())
        assert [c.arguments for c in out.calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}] and not out.content
        assert ended_at == (0 if pieces is whole else len(head) - 1)


def test_reasoning_split_opened_by_the_prompt_and_unclosed():
    out = run_parser(lambda: OutputParser(ReasoningSplit(started=True)), "still thinking </thi", by_chars)
    assert (out.reasoning, out.content) == ("still thinking </thi", "")
    out = run_parser(lambda: OutputParser(ReasoningSplit()), "No thought here.", by_chars)
    assert (out.reasoning, out.content) == ("", "No thought here.")
    out = run_parser(lambda: OutputParser(ReasoningSplit(started=True)), "a</think>\n\nb", by_chars)
    assert (out.reasoning, out.content) == ("a", "b")


@pytest.mark.parametrize("pieces", [whole, by_chars], ids=["whole", "by_chars"])
def test_grammar_kept_calls_stream_their_arguments_as_written(pieces):
    text = 'Ok.<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris, \\"FR\\" {x}"}}\n</tool_call>\n' \
           '<tool_call>\n{"name":"add","arguments":{"a":1,"b":{"c":[2]}}}\n</tool_call>'
    parser = OutputParser(None, ToolFormat("generic", False).parser(NAMES, stream_args=True))
    seen, heads_before_end = Piece(), 0
    for p in pieces(text):
        got = parser.feed(p)
        heads_before_end += sum(d.name is not None for d in got.deltas) if p != text else 0
        seen.add(got)
    seen.add(parser.finish())
    assert seen.content == "Ok." and [c.name for c in seen.calls] == ["get_weather", "add"]
    # the first call streams; a later one comes whole, once it is known to repeat no earlier call
    assert [c.streamed for c in seen.calls] == [True, False]
    first = seen.calls[0]
    frags = [d for d in seen.deltas if d.id == first.id]
    assert frags[0].name == first.name and all(d.name is None for d in frags[1:])
    assert json.loads("".join(d.arguments for d in frags)) == first.arguments
    assert not [d for d in seen.deltas if d.id == seen.calls[1].id]
    if pieces is by_chars:  # the name goes out long before the call ends
        assert heads_before_end == 1 and len([d for d in seen.deltas if d.name is None]) > 10


def test_call_ids_are_unique_and_arguments_are_json_text():
    out = run_parser(lambda: OutputParser(None, ToolFormat("hermes", True).parser(NAMES)),
                     f"<tool_call>{ADD_1}</tool_call><tool_call>{ADD_2}</tool_call>", whole)
    assert len({c.id for c in out.calls}) == 2
    assert json.loads(out.calls[0].arguments_json) == {"a": 1, "b": 2}


# --- request checks ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tools, field", [
    ("x", "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": 5}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "tools"),
])
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(ApiError) as err:
        parse_tools(tools)
    assert err.value.status == 400 and err.value.param == field


def test_tool_choice_forms():
    assert parse_tool_choice(None, FUNCTIONS) == "auto" and parse_tool_choice(None, ()) == "none"
    assert parse_tool_choice("required", FUNCTIONS) == "required"
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, FUNCTIONS) == "add"
    for bad, field in ((["x"], "tool_choice"), ("always", "tool_choice"),
                       ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name")):
        with pytest.raises(ApiError) as err:
            parse_tool_choice(bad, FUNCTIONS)
        assert err.value.param == field


def test_history_normalised_and_tool_messages_must_follow_a_call():
    raw = [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    texts = [{"role": m["role"], "content": m["content"] or ""} for m in raw]
    msgs = normalise_history(raw, texts)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert msgs[2]["tool_call_id"] == "c1"
    ollama = [raw[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
              {"role": "tool", "content": "-3 C", "tool_name": "get_weather"}]
    normalised = normalise_history(ollama, texts)
    assert normalised[2]["name"] == "get_weather"
    # Ollama sends no ids: each call gets 9 alphanumerics (Mistral's templates insist) and its result the same id
    assert normalised[2]["tool_call_id"] == normalised[1]["tool_calls"][0]["id"]
    assert len(normalised[1]["tool_calls"][0]["id"]) == 9 and normalised[1]["tool_calls"][0]["id"].isalnum()
    for bad, field in (([texts[0], texts[2]], "messages[1].role"),
                       ([raw[0], raw[1], {**raw[2], "tool_call_id": "c9"}], "messages[2].tool_call_id")):
        with pytest.raises(ApiError) as err:
            normalise_history(bad, [{"role": m["role"], "content": m["content"] or ""} for m in bad])
        assert err.value.param == field


# --- families and plans ------------------------------------------------------------------------------------------

HERMES_TEMPLATE = ("{%- if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools><|im_end|>\n{%- endif %}"
                   "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor %}"
                   "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
QWEN3_LIKE = HERMES_TEMPLATE.replace("{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
                                     "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is "
                                     "defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
                                     "{%- endif %}")


def test_model_traits_from_templates(smol_tokenizer):
    assert model_traits("LlamaForCausalLM", smol_tokenizer.chat_template).tools == ToolFormat("generic", False)
    assert model_traits("Qwen2ForCausalLM", HERMES_TEMPLATE).tools == ToolFormat("hermes", True)
    qwen3 = model_traits("Qwen3ForCausalLM", QWEN3_LIKE)
    assert qwen3.thinks and qwen3.tools.name == "hermes"
    assert model_traits("MistralForCausalLM", "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]").tools.name \
        == "mistral"
    assert model_traits("LlamaForCausalLM", None).tools.native is False


def test_generic_plan_describes_tools_and_renders_history_with_any_template(smol_tokenizer):
    spec = ToolSpec(FUNCTIONS, "required")
    raw = [{"role": "user", "content": "Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
           {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}, {"role": "tool", "content": "snow"}]
    msgs = generic_messages(raw, spec)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "get_weather" in msgs[0]["content"] and "must call" in msgs[0]["content"]
    assert "<tool_call>" in msgs[2]["content"] and "-3 C" in msgs[3]["content"] and "snow" in msgs[3]["content"]
    traits = model_traits("LlamaForCausalLM", smol_tokenizer.chat_template)
    plan = plan_chat(raw, spec, None, None, {}, traits)
    text = smol_tokenizer.apply_chat_template(plan.messages, tools=plan.tools, **plan.template_kwargs)
    assert "get_weather" in text and plan.tools is None
    constraint, parser = plan.output(text)
    assert constraint.kind == "lark" and parser.tools is not None


GEMMA2_LIKE = ("{%- for m in messages %}{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
               "{%- endif %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{%- endfor %}"
               "{%- if add_generation_prompt %}<start_of_turn>model\n{%- endif %}")


async def test_a_template_without_a_system_role_gets_the_tool_note_in_the_first_user_turn(smol_tokenizer):
    import copy

    from llmd.server.core import render_chat

    tok = copy.copy(smol_tokenizer)
    tok.chat_template = GEMMA2_LIKE
    traits = model_traits("Gemma2ForCausalLM", GEMMA2_LIKE)
    plan = plan_chat([{"role": "user", "content": "Oslo?"}], ToolSpec(FUNCTIONS, "required"), None, None, {}, traits)
    text = await render_chat(tok, plan)
    assert text.startswith("<start_of_turn>user\nYou can call the following tools") and "Oslo?" in text


def test_native_plan_passes_tools_to_the_template():
    traits = model_traits("Qwen3ForCausalLM", QWEN3_LIKE)
    plan = plan_chat([{"role": "user", "content": "hi"}], ToolSpec(FUNCTIONS), None, False, {}, traits)
    assert [t["function"]["name"] for t in plan.tools] == ["get_weather", "add"]
    assert plan.template_kwargs == {"enable_thinking": False}
    from llmd.model.chat_template import render_chat

    text = render_chat(QWEN3_LIKE, plan.messages, tools=plan.tools, **plan.template_kwargs)
    assert "<tools>" in text and text.endswith("<think>\n\n</think>")
    constraint, parser = plan.output(text)
    # auto on a native template: the model chooses (no grammar); thinking off: nothing to split
    assert constraint is None and parser.reasoning is None and parser.tools is not None


# --- grammars, run through llguidance with the SmolLM2 tokenizer --------------------------------------------------

def check(constraint, field: str) -> None:
    """The engine's compile (its error is the server's 400 naming `field`)."""
    from llmd.engine.grammar import grammar_source
    from llmd.engine.types import ConstraintError
    import llguidance

    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar_source(constraint))
    except ConstraintError as exc:
        problem = str(exc)
    if problem:
        raise ApiError(400, f"{field}: {problem}", param=field)


@pytest.fixture(scope="module")
def matcher_for(smol_tokenizer):
    import llguidance
    import llguidance.hf
    import transformers

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=smol_tokenizer.backend)
    ll = llguidance.hf.from_tokenizer(hf, eos_token=min(smol_tokenizer.eos_token_ids))

    def accepts(constraint, text: str) -> bool:
        kind = {"json_schema": "json_schema", "lark": "lark", "gbnf": "gbnf"}[constraint.kind]
        m = llguidance.LLMatcher(ll, llguidance.grammar_from(kind, constraint.text), log_level=0)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(smol_tokenizer.encode(text)) and m.is_accepting()

    return accepts


CALL = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'


def test_required_grammar_allows_only_valid_calls(matcher_for):
    generic = ToolFormat("generic", False)
    required = lark_grammar(generic, ToolSpec(FUNCTIONS, "required"), None, None)
    check(required, "tools")
    assert matcher_for(required, CALL)
    assert matcher_for(required, CALL + "\n" + CALL.replace('"a":1', '"a":7'))
    assert not matcher_for(required, "Sure, the answer is 3.")
    assert not matcher_for(required, CALL.replace('"b":2', '"b":"two"'))
    single = lark_grammar(generic, ToolSpec(FUNCTIONS, "required", parallel=False), None, None)
    assert matcher_for(single, CALL) and not matcher_for(single, CALL + "\n" + CALL)
    named = lark_grammar(generic, ToolSpec(FUNCTIONS, "get_weather"), None, None)
    oslo = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    assert not matcher_for(named, CALL) and matcher_for(named, oslo)
    # a named function is one call even with parallel calls allowed: the grammar ends after it
    assert not matcher_for(named, oslo + "\n" + oslo.replace("Oslo", "Rome"))
    for family in ("llama3", "mistral"):
        one = lark_grammar(ToolFormat(family, True), ToolSpec(FUNCTIONS, "add"), None, None)
        body = '{"name":"add","parameters":{"a":1,"b":2}}' if family == "llama3" else '[' + CALL[12:-13] + ']'
        assert matcher_for(one, body), family
        two = body + ";" + body if family == "llama3" else body[:-1] + "," + body[1:]
        assert not matcher_for(one, two), family


def test_auto_generic_grammar_allows_text_or_a_call(matcher_for):
    auto = lark_grammar(ToolFormat("generic", False), ToolSpec(FUNCTIONS, "auto"), None, None)
    assert matcher_for(auto, "Paris is the capital of France.") and matcher_for(auto, CALL)
    assert matcher_for(auto, "<div>HTML is text too</div>") and matcher_for(auto, "<tool_cab> is no tag")
    assert not matcher_for(auto, "<tool_call>\nnot json\n</tool_call>")
    assert not matcher_for(auto, "<tool_call>\n" + '{"name":"rm","arguments":{}}' + "\n</tool_call>")


def test_family_grammars_match_what_their_parsers_read(matcher_for):
    spec = ToolSpec(FUNCTIONS, "required")
    llama = lark_grammar(ToolFormat("llama3", True), spec, None, None)
    assert matcher_for(llama, '{"name":"add","parameters":{"a":1,"b":2}}')
    mistral = lark_grammar(ToolFormat("mistral", True), spec, None, None)
    assert matcher_for(mistral, '[{"name":"add","arguments":{"a":1,"b":2}}]')


def test_qwen3_coder_xml_grammar_and_typed_values(matcher_for):
    fns = parse_tools([{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
        "required": ["n", "text"]}}}])
    fmt = ToolFormat("qwen3_coder", True)
    g = lark_grammar(fmt, ToolSpec(fns, "required"), None, None)
    check(g, "tools")
    xml = '<tool_call>\n<function=note>\n<parameter=n>\n7\n</parameter>\n<parameter=text>\n123 <b>\n' \
          '</parameter>\n</function>\n</tool_call>'
    assert matcher_for(g, xml)
    assert not matcher_for(g, xml.replace("\n7\n", "\nseven\n"))
    out = run_parser(lambda: OutputParser(None, fmt.parser({fn.name: fn.parameters for fn in fns})), xml, by_chars)
    assert summary(out) == ("", "", [("note", {"n": 7, "text": "123 <b>"})])  # a string stays a string


def test_thought_stays_free_and_the_answer_follows_the_schema(matcher_for):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = AnswerFormat("json_schema", json.dumps(schema), "response_format")
    g = lark_grammar(None, None, fmt, "open")
    assert matcher_for(g, '<think>\nAnything {"at": all} goes.\n</think>\n\n{"city":"Paris"}')
    assert not matcher_for(g, '<think>\nhm\n</think>\n\nParis')
    opened = lark_grammar(None, None, fmt, "opened")
    assert matcher_for(opened, 'free text</think>{"city":"Rome"}')
    plain = answer_constraint(fmt)
    assert plain.kind == "json_schema" and matcher_for(plain, '{"city":"Paris"}')
    assert not matcher_for(plain, '{"city": 3}')
    assert matcher_for(answer_constraint(AnswerFormat("json_object", "", "format")), '{"any":[1,2]}')


@pytest.mark.parametrize("fmt, field", [
    (AnswerFormat("json_schema", json.dumps({"type": "string", "minLength": 5, "maxLength": 2}), "format"), "format"),
    (AnswerFormat("json_schema", json.dumps({"$ref": "#/$defs/missing"}), "response_format"), "response_format"),
    (AnswerFormat("gbnf", "root ::= undefined-rule", "grammar"), "grammar"),
    (AnswerFormat("gbnf", "root ::= (", "grammar"), "grammar"),
])
def test_invalid_or_unsatisfiable_constraints_are_400s_naming_the_field(fmt, field):
    with pytest.raises(ApiError) as err:
        check(answer_constraint(fmt), fmt.field)
    assert err.value.status == 400 and err.value.param == field


def test_gbnf_grammar_is_enforced(matcher_for):
    g = answer_constraint(AnswerFormat("gbnf", 'root ::= ("yes" | "no") "."', "grammar"))
    check(g, "grammar")
    assert matcher_for(g, "yes.") and not matcher_for(g, "maybe.")
