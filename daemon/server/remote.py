"""A remote engine: a model served by another server that speaks OpenAI's API (vLLM, SGLang, llama-server, TGI,
another llmd), behind the same seam as the local AsyncEngine, so every dialect, `llmd chat`, `llmd bench` and
/metrics work the same against it.

Its "steps" are HTTP calls: `submit` starts one streamed chat or text completion upstream (aiohttp client), and the
request's stream yields its pieces as RequestOutputs. The prompt never becomes token ids here: the tokenizer seam
hands back a `RemotePrompt`, a list of placeholder ids (one per ~4 characters, for the length checks) that carries
the messages or text. Upstream answers map to the client's: a 4xx keeps its status and message, a 5xx or a refused
connection is a 502, a timeout (connect or between two chunks) a 504; `RemoteStream.started()` waits for upstream's
status before the response starts, so a stream's status line says it too. A client that hangs up aborts its request:
the upstream call is cancelled and its connection closed, which the upstream server sees as a disconnect.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ..engine.types import EngineStats, FinishReason, RequestOutput, RequestTimings
from .validation import ApiError

if TYPE_CHECKING:
    import aiohttp

    from ..engine.types import Priority, SamplingParams

DEFAULT_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0
STREAM_BUFFER = 64
CHARS_PER_TOKEN = 4  # a placeholder count for length checks; upstream counts the real tokens
REMOTE_CONTEXT = 1 << 20  # upstream enforces its own context length
MAX_ERROR_CHARS = 500


class RemotePrompt(list):
    """Placeholder token ids (for length checks) carrying what upstream is sent: chat messages or a text."""

    def __init__(self, messages: list[dict] | None = None, text: str | None = None):
        chars = len(text or "") + sum(len(str(m.get("content") or "")) for m in messages or [])
        super().__init__([0] * max(1, chars // CHARS_PER_TOKEN))
        self.messages, self.text = messages, text


class RemoteTokenizer:
    """The tokenizer seam of a remote model: it tokenizes nothing (upstream does)."""

    chat_template = ""
    vocab_size = 1 << 31
    eos_token_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> RemotePrompt:
        return RemotePrompt(text=text)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> RemotePrompt:
        return RemotePrompt(messages=[{"role": m["role"], "content": m["content"]} for m in messages])

    def fim_token_ids(self) -> None:
        return None  # fill-in-the-middle prompts are built from a model's own tokens, which a remote model hides

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class RemoteConfig:
    max_model_len: int = REMOTE_CONTEXT
    max_num_seqs: int | None = None


def _upstream_body(prompt: list[int], params: SamplingParams, model: str) -> tuple[str, dict]:
    """(route, JSON body) for one request: chat messages go to /chat/completions, text and ids to /completions."""
    if params.logprobs is not None:
        raise ApiError(400, "logprobs are not supported for a remote model", param="logprobs")
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "max_tokens": params.max_tokens, "temperature": params.temperature,
                            "top_p": params.top_p}
    for key, value, neutral in (("presence_penalty", params.presence_penalty, 0.0),
                                ("frequency_penalty", params.frequency_penalty, 0.0), ("seed", params.seed, None),
                                ("top_k", params.top_k, 0), ("min_p", params.min_p, 0.0),
                                ("repetition_penalty", params.repetition_penalty, 1.0),
                                ("ignore_eos", params.ignore_eos, False)):
        if value != neutral:  # vLLM's extensions are sent only when used: not every server knows them
            body[key] = value
    if params.stop:
        body["stop"] = list(params.stop)
    if isinstance(prompt, RemotePrompt) and prompt.messages is not None:
        return "/chat/completions", {**body, "messages": prompt.messages}
    text = prompt.text if isinstance(prompt, RemotePrompt) else list(prompt)
    return "/completions", {**body, "prompt": text}


class RemoteStream:
    """One upstream request's outputs; the last has finished=True. Bounded: upstream is read no faster than the
    client takes the pieces."""

    def __init__(self, owner: RemoteEngine, request_id: str, route: str, body: dict, prompt_len: int):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_BUFFER)
        self._status: asyncio.Future = asyncio.get_running_loop().create_future()
        self._finished = False
        self.timings = RequestTimings(arrival=time.monotonic(), num_prompt_tokens=prompt_len)
        self._task = asyncio.get_running_loop().create_task(self._run(route, body))

    async def started(self) -> None:
        """Wait for upstream's status: ApiError (4xx as upstream said, 502, 504) when it refused the request."""
        await asyncio.shield(self._status)

    def abort(self) -> None:
        if not self._task.done():
            self._task.cancel()  # closes the upstream connection: the upstream server aborts its request
            self._owner.aborted_total += 1

    @property
    def finished(self) -> bool:
        return self._finished

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, ApiError):
            self._finished = True
            raise item
        if item.finished:
            self._finished = True
        return item

    async def _run(self, route: str, body: dict) -> None:
        owner = self._owner
        owner.running += 1
        try:
            await self._exchange(route, body)
        except ApiError as exc:
            self._fail(exc)
        except asyncio.TimeoutError:
            self._fail(ApiError(504, f"the remote server {owner.url} did not answer within {owner.timeout:g}s",
                                kind="gateway_timeout"))
        except OSError as exc:  # aiohttp's connection errors are OSErrors
            self._fail(ApiError(502, f"cannot reach the remote server {owner.url}: {exc}", kind="bad_gateway"))
        except Exception as exc:  # noqa: BLE001 - a malformed upstream answer, reported as upstream's
            self._fail(ApiError(502, f"bad answer from the remote server {owner.url}: {type(exc).__name__}: {exc}",
                                kind="bad_gateway"))
        finally:
            owner.running -= 1

    def _fail(self, exc: ApiError) -> None:
        if not self._status.done():
            self._status.set_exception(exc)
            self._status.exception()  # seen: a non-streaming request learns it from the queue instead
        if self._queue.full():
            self._queue.get_nowait()  # the request failed: the error matters more than a piece before it
        self._queue.put_nowait(exc)

    async def _exchange(self, route: str, body: dict) -> None:
        owner = self._owner
        assert owner.session is not None, "RemoteEngine.start() was not awaited"
        async with owner.session.post(owner.url + route, json=body, headers=owner.headers) as resp:
            if resp.status >= 400:
                raise _upstream_error(owner.url, resp.status, await resp.text())
            self._status.set_result(None)
            t = self.timings
            t.first_scheduled = time.monotonic()
            finish, usage = None, None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if event.get("error"):
                    err = event["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    raise ApiError(502, f"the remote server {owner.url} failed: {message}", kind="bad_gateway")
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                    finish = choice.get("finish_reason") or finish
                    if text:
                        now = time.monotonic()
                        t.first_token = t.first_token or now
                        t.token_times.append(now)
                        t.num_generated_tokens += 1
                        await self._queue.put(RequestOutput(self.request_id, [0], text))
            t.finished = time.monotonic()
            if usage:
                t.num_prompt_tokens = int(usage.get("prompt_tokens") or t.num_prompt_tokens)
                t.num_generated_tokens = int(usage.get("completion_tokens") or t.num_generated_tokens)
            owner.record(t)
            reason = FinishReason.LENGTH if finish == "length" else FinishReason.STOP
            await self._queue.put(RequestOutput(self.request_id, [], "", finished=True, finish_reason=reason,
                                                timings=t))


def _upstream_error(url: str, status: int, text: str) -> ApiError:
    try:
        err = json.loads(text).get("error")
        message = err.get("message") if isinstance(err, dict) else str(err or text)
    except (ValueError, AttributeError):
        message = text
    message = " ".join(str(message).split())[:MAX_ERROR_CHARS]
    if 400 <= status < 500:
        return ApiError(status, f"the remote server {url} answered {status}: {message}",
                        kind="model_not_found" if status == 404 else "invalid_request_error")
    return ApiError(502, f"the remote server {url} answered {status}: {message}", kind="bad_gateway")


class RemoteEngine:
    """The engine seam (submit, tokenizer, loaded, stats, shutdown) over an OpenAI-compatible server."""

    def __init__(self, name: str, table: dict):
        self.name = name
        self.url = str(table["url"]).rstrip("/")
        self.remote_model = str(table.get("model") or name)
        self.timeout = float(table.get("timeout") or DEFAULT_TIMEOUT_S)
        self.headers = {"Authorization": f"Bearer {table['api_key']}"} if table.get("api_key") else {}
        self.tokenizer = RemoteTokenizer()
        self.config = RemoteConfig()
        self.engine = self  # what the server reads through AsyncEngine.engine.config
        self.loaded = SimpleNamespace(name=name, dtype="remote", config=SimpleNamespace(
            architecture="remote", max_position_embeddings=REMOTE_CONTEXT, hidden_size=0, num_hidden_layers=0,
            num_attention_heads=0, num_key_value_heads=0))
        self.session: aiohttp.ClientSession | None = None
        self.running = 0
        self.aborted_total = 0
        self.finished_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.error: str | None = None

    async def start(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, connect=min(CONNECT_TIMEOUT_S, self.timeout),
                                        sock_read=self.timeout)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def shutdown(self) -> None:
        if self.session is not None:
            await self.session.close()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, priority: Priority | None = None,
               request_id: str | None = None) -> RemoteStream:
        route, body = _upstream_body(prompt_token_ids, params, self.remote_model)
        return RemoteStream(self, request_id or uuid.uuid4().hex, route, body, len(prompt_token_ids))

    def record(self, t: RequestTimings) -> None:
        self.finished_total += 1
        self.prompt_tokens_total += t.num_prompt_tokens
        self.generation_tokens_total += t.num_generated_tokens

    def stats(self) -> EngineStats:
        """What this side sees: its requests and tokens; the KV pool and the latency split live upstream."""
        return EngineStats(requests_running=self.running, requests_finished_total=self.finished_total,
                           prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=self.generation_tokens_total, remote_url=self.url)
