"""Benchmark workloads, generated on the spot from a seed (nothing is downloaded), or read from a JSONL file.

Each workload stresses one part of a server:
- chat           varied short prompts and answer lengths (a mixed, everyday load)
- shared-prefix  one long system prompt shared by every request, varied questions (exercises the prefix cache)
- long-prompt    long documents to summarise with short answers (prefill-heavy)
- code-edit      "return this code with one change" (answers copy the prompt: good for speculative decoding)
- a JSONL file   one request per line: {"prompt": "..."} or {"messages": [...]}, optional "max_tokens"
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LlmdError

WORKLOADS = ("chat", "shared-prefix", "long-prompt", "code-edit")

# Caps that keep a user's file (or a typo in a flag) from building an unbounded workload.
MAX_FILE_REQUESTS = 100_000
MAX_FILE_BYTES = 64 * 1024 * 1024


class WorkloadError(LlmdError):
    pass


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, usable on both /v1/chat/completions and /v1/completions."""

    messages: tuple[dict, ...] = field(default_factory=tuple)
    prompt: str | None = None
    max_tokens: int = 64
    kind: str = "chat"

    def chat_messages(self) -> list[dict]:
        if self.messages:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def completion_prompt(self) -> str:
        if self.prompt is not None:
            return self.prompt
        # A plain transcript: enough for a completion endpoint to continue from.
        lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in self.messages]
        return "\n".join(lines) + "\nassistant:"


_TOPICS = [
    "the water cycle", "black holes", "sourdough bread", "the French revolution", "photosynthesis",
    "compound interest", "plate tectonics", "how vaccines work", "the history of chess", "jazz improvisation",
    "electric cars", "the Roman empire", "machine learning", "coral reefs", "the printing press",
    "volcanoes", "the stock market", "honey bees", "quantum computing", "the Silk Road",
]
_ASKS = [
    "Explain {t} to a curious teenager.", "Give three surprising facts about {t}.",
    "Write a short poem about {t}.", "What are the main open questions about {t}?",
    "Summarise {t} in two sentences.", "Why does {t} matter today?",
    "Describe {t} as if you were a tour guide.", "List the key terms someone should know about {t}.",
]
_FILLER = [
    "I am preparing a short talk for a community group.", "Please keep the tone friendly.",
    "Avoid jargon where you can.", "I already know the basics.", "This is for a school project.",
    "My friend claims it is overrated.", "I read an article about it yesterday.",
    "Use a concrete example.", "Answer as plainly as you can.",
]
_WORDS = (
    "system network memory signal river market garden theory engine window harvest ledger planet archive "
    "cluster bridge lantern quarry meadow circuit harbor compass violin glacier orbit canyon festival "
    "library tunnel mirror beacon prairie cascade summit pattern kernel thread buffer voltage"
).split()


def _sentence(rng: random.Random, words: int) -> str:
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return body[0].upper() + body[1:] + "."


def _paragraphs(rng: random.Random, total_words: int) -> str:
    out, left = [], total_words
    while left > 0:
        n = min(left, rng.randint(8, 16))
        out.append(_sentence(rng, n))
        left -= n
    return " ".join(out)


def _chat(rng: random.Random, max_tokens: int) -> BenchRequest:
    topic = rng.choice(_TOPICS)
    parts = [rng.choice(_ASKS).format(t=topic)] + rng.sample(_FILLER, rng.randint(0, 3))
    # Varied answer lengths, between half and all of the cap.
    tokens = rng.randint(max(1, max_tokens // 2), max_tokens)
    return BenchRequest(messages=({"role": "user", "content": " ".join(parts)},), max_tokens=tokens, kind="chat")


def _shared_system_prompt(seed: int, words: int) -> str:
    rng = random.Random(f"shared-prefix-{seed}")  # same for every request of the run
    rules = _paragraphs(rng, words)
    return "You are the support assistant of the Lantern Archive. Follow the house rules below.\n" + rules


def _shared_prefix(rng: random.Random, max_tokens: int, system: str) -> BenchRequest:
    topic = rng.choice(_TOPICS)
    question = rng.choice(_ASKS).format(t=topic)
    return BenchRequest(
        messages=({"role": "system", "content": system}, {"role": "user", "content": question}),
        max_tokens=max_tokens, kind="shared-prefix",
    )


def _long_prompt(rng: random.Random, max_tokens: int, words: int) -> BenchRequest:
    document = _paragraphs(rng, rng.randint(max(1, words * 3 // 4), words))
    content = f"Here is a document:\n\n{document}\n\nSummarise the document in one sentence."
    return BenchRequest(messages=({"role": "user", "content": content},), max_tokens=max_tokens, kind="long-prompt")


def _code_snippet(rng: random.Random, functions: int) -> tuple[str, str]:
    names = rng.sample(_WORDS, k=min(len(_WORDS), functions + 1))
    var = names[-1]
    blocks = []
    for name in names[:functions]:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        blocks.append(
            f"def {name}_total({var}, items):\n"
            f"    result = {a}\n"
            f"    for item in items:\n"
            f"        result += item * {var} + {b}\n"
            f"    return result\n"
        )
    return "\n\n".join(blocks), var


def _code_edit(rng: random.Random, max_tokens: int) -> BenchRequest:
    code, var = _code_snippet(rng, rng.randint(2, 4))
    content = (
        f"Rename the parameter `{var}` to `factor` everywhere in this Python code. "
        f"Return the complete code and nothing else.\n\n```python\n{code}```"
    )
    return BenchRequest(messages=({"role": "user", "content": content},), max_tokens=max_tokens, kind="code-edit")


def make_workload(kind: str, count: int, *, seed: int = 0, max_tokens: int = 64,
                  prompt_words: int | None = None) -> list[BenchRequest]:
    """`count` requests of a generated workload; the same seed gives the same requests."""
    if count < 1:
        raise WorkloadError("the workload needs at least one request")
    if max_tokens < 1:
        raise WorkloadError("--max-tokens must be at least 1")
    rng = random.Random(f"{kind}-{seed}")
    if kind == "chat":
        return [_chat(rng, max_tokens) for _ in range(count)]
    if kind == "shared-prefix":
        system = _shared_system_prompt(seed, prompt_words or 600)
        return [_shared_prefix(rng, max_tokens, system) for _ in range(count)]
    if kind == "long-prompt":
        return [_long_prompt(rng, max_tokens, prompt_words or 1200) for _ in range(count)]
    if kind == "code-edit":
        return [_code_edit(rng, max_tokens) for _ in range(count)]
    raise WorkloadError(f"unknown workload {kind!r}: choose one of {', '.join(WORKLOADS)}, or give --prompts FILE.jsonl")


def _request_from_line(obj, where: str, max_tokens: int) -> BenchRequest:
    if isinstance(obj, str):
        return BenchRequest(prompt=obj, max_tokens=max_tokens, kind="file")
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected an object with \"prompt\" or \"messages\"")
    tokens = obj.get("max_tokens", max_tokens)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise WorkloadError(f"{where}: \"max_tokens\" must be a positive integer")
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs
        )
        if not ok:
            raise WorkloadError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} strings")
        return BenchRequest(messages=tuple(dict(m) for m in msgs), max_tokens=tokens, kind="file")
    if isinstance(obj.get("prompt"), str):
        return BenchRequest(prompt=obj["prompt"], max_tokens=tokens, kind="file")
    raise WorkloadError(f"{where}: expected \"prompt\" (a string) or \"messages\" (a list)")


def load_prompts_file(path: str | Path, *, max_tokens: int = 64) -> list[BenchRequest]:
    """Read the user's prompts: one JSON value per line (blank lines and lines starting with # are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"prompts file {path} does not exist")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise WorkloadError(f"prompts file {path} is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB")
    requests = []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{where}: not valid JSON ({exc.msg})") from None
            requests.append(_request_from_line(obj, where, max_tokens))
            if len(requests) > MAX_FILE_REQUESTS:
                raise WorkloadError(f"{path}: more than {MAX_FILE_REQUESTS} prompts")
    if not requests:
        raise WorkloadError(f"prompts file {path} has no prompts")
    return requests
