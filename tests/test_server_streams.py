"""Streams open at once and stay alive while their prompt waits or is prefilled: a real `llmd serve` on the bundled
SmolLM2 with a keep-alive of 20 ms (the stream_keepalive setting, 10 s by default) and prefill chunks of 64 tokens,
so that a prompt of a few hundred tokens takes several steps. Each dialect's stream is read raw with aiohttp, line
by line as an SSE or NDJSON reader gets it, and through the official clients, which must take the keep-alives in
stride."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from llmd_daemon_proc import start_daemon

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("llmd_streams"),
                     env={"LLMD_STREAM_KEEPALIVE": "0.02", "LLMD_MAX_NUM_BATCHED_TOKENS": "64"})
    yield d
    assert d.stop() == 0, d.log()


def _prompt(tag: str, stones: int) -> str:
    """A prompt no other request shares a prefix with (nothing comes from the prefix cache)."""
    return f"{tag}. " + " ".join(f"Stone {i} of {tag} is grey." for i in range(stones)) + " How many stones?"


async def _lines(http: aiohttp.ClientSession, path: str, body: dict) -> list[str]:
    async with http.post(path, json=body) as r:
        assert r.status == 200, await r.text()
        return [line.decode().rstrip("\n") async for line in r.content if line.strip()]


def _sse(lines: list[str]) -> list:
    """SSE lines as events: a comment is the string KEEP, data its JSON object (named events' `event:` lines are
    left out: their data names the type too)."""
    return ["KEEP" if line == ": keep-alive" else json.loads(line[6:]) for line in lines
            if line == ": keep-alive" or (line.startswith("data: ") and line != "data: [DONE]")]


def _before(events: list, is_output) -> list:
    """The events before the first one that carries output."""
    first = next(i for i, e in enumerate(events) if is_output(e))
    return events[:first]


async def test_every_dialect_opens_at_once_and_keeps_a_long_prefill_alive(daemon):
    model = daemon.stats()["model"]
    one = {"max_tokens": 2, "temperature": 0}
    requests = {
        "openai": ("/v1/chat/completions", {"messages": [{"role": "user", "content": _prompt("A", 25)}],
                                            "stream": True, **one}),
        "anthropic": ("/v1/messages", {"model": model, "messages": [{"role": "user", "content": _prompt("B", 25)}],
                                       "stream": True, **one}),
        "responses": ("/v1/responses", {"input": _prompt("C", 25), "stream": True, "max_output_tokens": 2,
                                        "temperature": 0}),
        "ollama": ("/api/chat", {"model": model, "messages": [{"role": "user", "content": _prompt("D", 25)}],
                                 "options": {"num_predict": 2, "temperature": 0}}),
        "llamacpp": ("/completion", {"prompt": _prompt("E", 100), "n_predict": 2, "temperature": 0, "stream": True,
                                     "return_progress": True}),
    }
    async with aiohttp.ClientSession(daemon.url) as http:
        got = dict(zip(requests, await asyncio.gather(*(_lines(http, *r) for r in requests.values()))))

    # OpenAI chat: the role chunk first, then SSE comments until the first token
    events = _sse(got["openai"])
    head = _before(events, lambda e: e != "KEEP" and e["choices"] and e["choices"][0]["delta"].get("content"))
    assert head[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert head[1:] and set(head[1:]) == {"KEEP"}

    # Anthropic: message_start and ping, then pings (its own keep-alive) until the first content block
    events = _sse(got["anthropic"])
    head = [e["type"] for e in _before(events, lambda e: e["type"] == "content_block_start")]
    assert head[:2] == ["message_start", "ping"] and len(head) > 2 and set(head[2:]) == {"ping"}
    assert events[-1]["type"] == "message_stop" and ": keep-alive" not in got["anthropic"]

    # Responses: created and in_progress, then SSE comments until the first output item
    events = _sse(got["responses"])
    head = _before(events, lambda e: e != "KEEP" and e["type"] == "response.output_item.added")
    assert [e["type"] for e in head[:2]] == ["response.created", "response.in_progress"]
    assert head[2:] and set(head[2:]) == {"KEEP"}
    assert [e["sequence_number"] for e in events if e != "KEEP"] == list(range(len(events) - events.count("KEEP")))

    # Ollama (NDJSON has no comments): empty chunks, not done, until the first token
    chunks = [json.loads(line) for line in got["ollama"]]
    head = _before(chunks, lambda c: c["message"]["content"] or c["done"])
    assert len(head) > 1 and all(c["message"] == {"role": "assistant", "content": ""} and not c["done"]
                                 for c in head)
    assert chunks[-1]["done"] and chunks[-1]["eval_count"] == 2

    # llama.cpp: prompt_progress as the prefill goes, `processed` growing, before the first token
    events = _sse(got["llamacpp"])
    head = _before(events, lambda e: e != "KEEP" and (e["content"] or e["stop"]))
    progress = [e["prompt_progress"] for e in head if e != "KEEP"]
    total = events[-1]["tokens_evaluated"]
    assert len(progress) >= 2 and all(p["total"] == total and p["cache"] == 0 for p in progress)
    processed = [p["processed"] for p in progress]
    assert processed == sorted(set(processed)) and 0 < processed[-1] <= total
    assert [p["time_ms"] for p in progress] == sorted(p["time_ms"] for p in progress)
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 2


def test_clients_take_keep_alives_in_stride(daemon):
    """With a keep-alive every 20 ms, comments, pings and empty chunks come between the tokens too: each official
    client streams the same text as its whole answer."""
    import anthropic
    import ollama
    import openai

    model = daemon.stats()["model"]
    ask = [{"role": "user", "content": "Name three colours."}]
    oai = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    whole = oai.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0)
    chunks = list(oai.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    response = oai.responses.create(model=model, input=ask, max_output_tokens=8, temperature=0)
    events = list(oai.responses.create(model=model, input=ask, max_output_tokens=8, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text

    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=8, messages=ask, extra_body={"temperature": 0})
    with claude.messages.stream(model=model, max_tokens=8, messages=ask, extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().content[0].text == message.content[0].text

    client = ollama.Client(host=daemon.url)
    answer = client.chat(model=model, messages=ask, options={"num_predict": 8, "temperature": 0})
    parts = list(client.chat(model=model, messages=ask, stream=True, options={"num_predict": 8, "temperature": 0}))
    assert "".join(p.message.content for p in parts) == answer.message.content and parts[-1].done
    assert all(not p.done for p in parts[:-1]) and parts[0].message.content == ""
