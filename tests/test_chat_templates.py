"""The real chat templates of the families (tests/chat_templates/, from the models' tokenizer_config.json) rendered
in llmd's sandbox equal transformers' apply_chat_template, with tools absent and present; a template that raises
gives an InvalidRequest carrying its message."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from llmd.errors import InvalidRequest
from llmd.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"

# template file -> (bos, eos) of the family
FAMILIES = {
    "llama-3.1-instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2-instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5-instruct": (None, "<|im_end|>"),
    "qwen3": (None, "<|im_end|>"),
    "gemma-2-it": ("<bos>", "<eos>"),
    "gemma-3-it": ("<bos>", "<eos>"),
    "mistral-7b-instruct-v0.3": ("<s>", "</s>"),
    "phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "gpt-oss": ("<|startoftext|>", "<|return|>"),
    "gemma-4-it": ("<bos>", "<eos>"),
    "qwen3.5": (None, "<|im_end|>"),
}
TOOL_FAMILIES = {"llama-3.1-instruct", "llama-3.2-instruct", "qwen2.5-instruct", "qwen3", "mistral-7b-instruct-v0.3",
                 "gpt-oss", "gemma-4-it", "qwen3.5"}
# how each family writes the tool round's call
CALL_TEXT = {"gemma-4-it": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
             "qwen3.5": "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"}
NO_SYSTEM_ROLE = {"gemma-2-it"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
            "required": ["city"],
        },
    },
}
CHATS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 😀"}],
    "multi_turn": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Write  code:\n    x = 1"},
    ],
}
TOOL_ROUND = [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call00042", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call00042", "content": "22 C, sunny"},
]


def _pair(name: str):
    """Our Tokenizer and a transformers tokenizer with the same special tokens and template."""
    from transformers import PreTrainedTokenizerFast

    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    bos, eos = FAMILIES[name]
    ours = Tokenizer(Backend(models.BPE()), bos_token=bos, eos_token=eos, chat_template=template)
    ref = PreTrainedTokenizerFast(tokenizer_object=Backend(models.BPE()), bos_token=bos, eos_token=eos)
    ref.chat_template = template
    return ours, ref


def _same(ours, ref, messages, **kwargs) -> str:
    """Both renderings (with and without the generation prompt) agree; returns the one with it."""
    for gen in (False, True):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
        assert ours.apply_chat_template(messages, gen, **kwargs) == expected
    return expected


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("chat", CHATS)
def test_template_matches_transformers(name, chat):
    ours, ref = _pair(name)
    if chat == "system" and name in NO_SYSTEM_ROLE:  # more in test_gemma_system_role
        with pytest.raises(InvalidRequest, match="System role not supported"):
            ours.apply_chat_template(CHATS[chat])
        return
    _same(ours, ref, CHATS[chat])
    if name in TOOL_FAMILIES:  # the same chat with a tool offered
        text = _same(ours, ref, CHATS[chat], tools=[WEATHER_TOOL])
        assert "get_weather" in text and "City name, e.g. Paris" in text
    else:  # templates without tool support ignore them
        assert ours.apply_chat_template(CHATS[chat], tools=[WEATHER_TOOL]) == ours.apply_chat_template(CHATS[chat])


@pytest.mark.parametrize("name", sorted(TOOL_FAMILIES))
def test_tool_call_round_matches_transformers(name):
    ours, ref = _pair(name)
    messages = TOOL_ROUND[1:] if name.startswith("llama") else TOOL_ROUND
    text = _same(ours, ref, messages, tools=[WEATHER_TOOL])
    assert "22 C, sunny" in text and CALL_TEXT.get(name, '"city": "Paris"') in text


def test_llama3_date_and_tool_preamble():
    ours, ref = _pair("llama-3.1-instruct")
    text = _same(ours, ref, CHATS["system"])
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe terse." in text
    assert "Environment: ipython" not in text
    assert "Today Date: 01 Dec 2026" in _same(ours, ref, CHATS["system"], date_string="01 Dec 2026")
    text = _same(ours, ref, CHATS["system"], tools=[WEATHER_TOOL])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    # the tools go in the first user turn unless tools_in_user_message is false, then in the system turn
    user_turn = text.split("<|start_header_id|>user<|end_header_id|>\n\n")[1]
    assert user_turn.startswith("Given the following functions") and '"name": "get_weather"' in user_turn
    text = _same(ours, ref, CHATS["system"], tools=[WEATHER_TOOL], tools_in_user_message=False)
    assert "You have access to the following functions" in text.split("<|eot_id|>")[0]
    with pytest.raises(InvalidRequest, match="no first user message"):  # the template's own raise_exception
        ours.apply_chat_template([{"role": "system", "content": "x"}], tools=[WEATHER_TOOL])


def test_llama32_date_is_today():
    from datetime import datetime

    ours, ref = _pair("llama-3.2-instruct")
    text = _same(ours, ref, CHATS["user"])  # both render strftime_now; a test run across midnight could differ
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n\n" in text
    assert "Today Date: 01 Dec 2026" in _same(ours, ref, CHATS["user"], date_string="01 Dec 2026")


def test_qwen3_thinking_switch():
    ours, ref = _pair("qwen3")
    assert _same(ours, ref, CHATS["user"], enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert _same(ours, ref, CHATS["user"], enable_thinking=True).endswith("<|im_start|>assistant\n")
    # an earlier answer's reasoning is dropped from the history, the last one's is kept
    history = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
               {"role": "user", "content": "3+3?"}]
    text = _same(ours, ref, history)
    assert "add" not in text and "<|im_start|>assistant\n4<|im_end|>" in text


def test_gemma4_system_thinking_and_tool_results():
    ours, ref = _pair("gemma-4-it")
    # thinking is off unless asked: the template closes an empty thought channel itself
    assert _same(ours, ref, CHATS["system"]) == (
        "<bos><|turn>system\nBe terse.<turn|>\n<|turn>user\nHi 😀<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    assert _same(ours, ref, CHATS["system"], enable_thinking=True) == (
        "<bos><|turn>system\n<|think|>\nBe terse.<turn|>\n<|turn>user\nHi 😀<turn|>\n<|turn>model\n")
    # the tools are declared in the system turn in Gemma's syntax; a result goes back into the calling model turn,
    # which the answer continues (no new turn; with thinking on, a thought channel is opened for it)
    text = _same(ours, ref, TOOL_ROUND, tools=[WEATHER_TOOL])
    assert ('<|tool>declaration:get_weather{description:<|"|>Current weather in a city<|"|>,parameters:{properties:'
            '{city:{description:<|"|>City name, e.g. Paris<|"|>,type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],'
            'type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n') in text
    assert text.endswith('<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                         '<|tool_response>response:get_weather{value:<|"|>22 C, sunny<|"|>}<tool_response|>')
    thinking = _same(ours, ref, TOOL_ROUND, tools=[WEATHER_TOOL], enable_thinking=True)
    assert thinking == text.replace("system\n", "system\n<|think|>\n", 1) + "<|channel>thought\n"
    # a call's reasoning is shown with it while the tool loop goes on, not after the next user message
    calls = [*TOOL_ROUND[:2], {**TOOL_ROUND[2], "reasoning_content": "Look it up."}, TOOL_ROUND[3]]
    assert "<|turn>model\n<|channel>thought\nLook it up.\n<channel|><|tool_call>" in _same(
        ours, ref, calls, tools=[WEATHER_TOOL])
    later = _same(ours, ref, [*calls, {"role": "assistant", "content": "Sunny."}, CHATS["user"][0]],
                  tools=[WEATHER_TOOL])
    assert "Look it up." not in later and "<tool_response|>Sunny.<turn|>\n<|turn>user\n" in later


def test_qwen35_thinking_switch_and_a_calls_reasoning():
    ours, ref = _pair("qwen3.5")
    assert _same(ours, ref, CHATS["user"]).endswith("<|im_start|>assistant\n<think>\n")  # it thinks unless told
    assert _same(ours, ref, CHATS["user"], enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    calls = [*TOOL_ROUND[:2], {**TOOL_ROUND[2], "reasoning_content": "Look it up."}, TOOL_ROUND[3]]
    text = _same(ours, ref, calls, tools=[WEATHER_TOOL])
    assert ("<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n"
            "<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n") in text
    later = _same(ours, ref, [*calls, {"role": "assistant", "content": "Sunny."}, CHATS["user"][0]],
                  tools=[WEATHER_TOOL])
    assert "Look it up." not in later


def test_gpt_oss_effort_and_a_calls_reasoning():
    ours, ref = _pair("gpt-oss")
    assert "\nReasoning: high\n" in _same(ours, ref, CHATS["user"], reasoning_effort="high")
    assert "\nReasoning: medium\n" in _same(ours, ref, CHATS["user"])
    # a call's reasoning is shown with it (as `thinking`), a final answer's is not
    calls = [*TOOL_ROUND[:2], {**TOOL_ROUND[2], "thinking": "Look it up."}, TOOL_ROUND[3]]
    text = _same(ours, ref, calls, tools=[WEATHER_TOOL])
    assert "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather" in text
    answered = [*calls, {"role": "assistant", "content": "Sunny.", "thinking": "Say it."}, CHATS["user"][0]]
    text = _same(ours, ref, answered, tools=[WEATHER_TOOL])
    assert "Say it." not in text and "Look it up." not in text and "final<|message|>Sunny.<|end|>" in text


def test_gemma_system_role():
    # Gemma 3 folds the system message into the first user turn; Gemma 2's template refuses it, and that refusal
    # is a clear InvalidRequest with the template's own message (the server's 400)
    ours, ref = _pair("gemma-3-it")
    text = _same(ours, ref, CHATS["system"])
    assert text == "<bos><start_of_turn>user\nBe terse.\n\nHi 😀<end_of_turn>\n<start_of_turn>model\n"
    ours, ref = _pair("gemma-2-it")
    with pytest.raises(InvalidRequest, match="System role not supported") as err:
        ours.apply_chat_template(CHATS["system"])
    assert err.value.field == "messages"
    with pytest.raises(Exception, match="System role not supported"):  # transformers refuses it the same way
        ref.apply_chat_template(CHATS["system"], tokenize=False)
    with pytest.raises(InvalidRequest, match="must alternate"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_mistral_tool_call_ids_are_checked_by_the_template():
    ours, _ = _pair("mistral-7b-instruct-v0.3")
    bad = [dict(m) for m in TOOL_ROUND]
    bad[2] = {"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    with pytest.raises(InvalidRequest, match="length 9"):
        ours.apply_chat_template(bad, tools=[WEATHER_TOOL])


# ---- where templates come from: tokenizer_config.json (one or named), chat_template.jinja/.json, GGUF metadata

DEFAULT_TPL = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TOOL_USE_TPL = "TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}" + DEFAULT_TPL


def _hf_folder(tmp_path, source: Path, config: dict, files: dict[str, str] | None = None) -> Path:
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    return folder


def test_named_templates_from_tokenizer_config(tmp_path, tiny_qwen2):
    from transformers import AutoTokenizer

    named = [{"name": "default", "template": DEFAULT_TPL}, {"name": "tool_use", "template": TOOL_USE_TPL}]
    folder = _hf_folder(tmp_path, tiny_qwen2, {"chat_template": named})
    ours, ref = Tokenizer.from_hf_folder(folder), AutoTokenizer.from_pretrained(folder)
    for tools in (None, [WEATHER_TOOL]):
        assert ours.apply_chat_template(CHATS["user"], False, tools=tools) == ref.apply_chat_template(
            CHATS["user"], tools=tools, tokenize=False)
    assert ours.apply_chat_template(CHATS["user"], tools=[WEATHER_TOOL]).startswith("TOOLS:get_weather;")


@pytest.mark.parametrize("file_name", ["chat_template.jinja", "chat_template.json"])
def test_template_files_in_hf_folder(tmp_path, tiny_qwen2, file_name):
    import json

    text = DEFAULT_TPL if file_name.endswith(".jinja") else json.dumps({"chat_template": DEFAULT_TPL})
    tok = Tokenizer.from_hf_folder(_hf_folder(tmp_path, tiny_qwen2, {}, {file_name: text}))
    assert tok.has_chat_template and tok.apply_chat_template(CHATS["user"], False).startswith("<|im_start|>user\n")
    bare = Tokenizer.from_hf_folder(_hf_folder(tmp_path / "bare", tiny_qwen2, {}))
    assert not bare.has_chat_template


def test_named_templates_from_gguf(smollm2_gguf):
    from llmd.model.gguf import read_gguf_metadata

    meta = read_gguf_metadata(smollm2_gguf)
    tok = Tokenizer.from_gguf({**meta, "tokenizer.chat_template.tool_use": TOOL_USE_TPL}, smollm2_gguf)
    assert tok.apply_chat_template(CHATS["user"], tools=[WEATHER_TOOL]).startswith("TOOLS:get_weather;")
    assert tok.apply_chat_template(CHATS["user"]) == Tokenizer.from_gguf(meta).apply_chat_template(CHATS["user"])
