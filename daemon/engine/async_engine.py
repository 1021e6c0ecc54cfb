"""AsyncEngine: the engine loop in its own thread, with an asyncio front for the server.

The event loop never waits on the model: submit() validates at once and queues a command; the engine thread drains
commands before every step, runs the step, and hands the outputs back with call_soon_threadsafe. On the CPU it takes
each step in turn with the process's other engines (engine/turns.py), so two models share the cores fairly; it first
sets its own CPU thread count (EngineConfig.threads, Engine.use_threads), as torch's and OpenMP's are per thread.
Each request reads its outputs from a RequestStream whose buffer is bounded: when a slow reader lets it fill, new
outputs are merged into the last buffered one (tokens and text concatenated), so nothing is lost and nothing grows
without limit.
If a step raises, every in-flight request ends with an error output, and the engine is marked dead (stats show
it, and submit raises EngineDead) rather than leaving requests hanging.

Grammars (SamplingParams.constraint) compile on a small thread pool, never on the engine thread or the event loop:
`await compile_constraint(c)` before submit() raises ConstraintError for a bad one (the server's 400) and warms the
cache; submit() itself takes a cached grammar at once, raises for a cached failure, and otherwise lets the request
wait for its compile while the step loop goes on (a failure then ends its stream with an error output).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque

from ..errors import EngineDead, InvalidRequest, QueueFull
from .engine import Engine, EngineStats
from .grammar import COMPILE_TIMEOUT_S, CompiledGrammar
from .turns import turns_for
from .types import (Constraint, ConstraintError, EmbedParams, FinishReason, ImageSpan, Priority, PromptProgress,
                    RequestOutput, SamplingParams)

log = logging.getLogger(__name__)

STREAM_BUFFER = 64
IDLE_WAIT_S = 0.5
GRAMMAR_THREADS = 2


class RequestStream:
    """Async iterator over one request's outputs; the last one has finished=True."""

    def __init__(self, request_id: str, owner: "AsyncEngine", maxlen: int = STREAM_BUFFER):
        self.request_id = request_id
        self._owner = owner
        self._maxlen = maxlen
        self._buf: deque[RequestOutput] = deque()
        self._event = asyncio.Event()
        self._finished = False  # the final output has been queued
        self._done = False  # the final output has been read

    def _put(self, out: RequestOutput) -> None:
        if self._finished:
            return
        if len(self._buf) >= self._maxlen:
            self._buf[-1] = self._buf[-1].merge(out)
        else:
            self._buf.append(out)
        self._finished = out.finished
        self._event.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._buf:
            if self._done or (self._finished and not self._buf):
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
        out = self._buf.popleft()
        if out.finished:
            self._done = True
        return out

    @property
    def finished(self) -> bool:
        return self._finished

    def abort(self) -> None:
        if not self._finished:
            self._owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine, stream_buffer: int = STREAM_BUFFER):
        self.engine = engine
        self.stream_buffer = stream_buffer
        self._lock = threading.Lock()
        self._commands: deque[tuple] = deque()  # bounded in practice: adds are capped by max_queue below
        self._num_pending_adds = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # touched only on the event loop thread
        self.error: str | None = None
        self.started_at: float | None = None
        self._compiler = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="llmd-grammar")
        self._grammar_wait: list[tuple] = []  # add commands whose grammar is still compiling (engine thread only)
        self._turns = turns_for(engine.device.type)  # CPU engines step in turns with the process's others (turns.py)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def loaded(self):
        return self.engine.loaded

    @property
    def max_embed_tokens(self) -> int:
        return self.engine.max_embed_tokens

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="llmd-engine", daemon=True)
        self._thread.start()
        self._compiler.submit(self.engine.grammars.warm_up)  # the first grammar then compiles in milliseconds

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._fail_all("the engine shut down", FinishReason.ABORT)

    # ---- requests (event loop thread) -------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               priority: Priority = Priority.INTERACTIVE, request_id: str | None = None,
               embed: EmbedParams | None = None, images: list[ImageSpan] | None = None) -> RequestStream:
        """Queue a request; embed: an embedding request instead (see embed()); images: the prompt's images, each at
        its placeholder tokens (llmd.model.vision)."""
        if self.error is not None:
            raise EngineDead(f"the engine stopped after an internal error: {self.error}")
        if self._thread is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", field="request_id")
        self.engine.check_request(prompt_token_ids, params, embed)
        grammar = None
        if params.constraint is not None and embed is None:
            cached = self.engine.grammars.cached(params.constraint)
            if isinstance(cached, ConstraintError):  # known bad: refused now; a compile started here fails in-stream
                raise ConstraintError(str(cached), field=cached.field)
            grammar = self._grammar(params.constraint)
        with self._lock:
            # as Engine.add_request counts it: the adds not yet handed over wait only beyond the free running places
            scheduler = self.engine.scheduler
            if scheduler.num_waiting + self._num_pending_adds - scheduler.free_slots >= self.engine.config.max_queue:
                raise QueueFull(f"the queue is full ({self.engine.config.max_queue} requests waiting)")
            self._num_pending_adds += 1
            stream = RequestStream(request_id, self, self.stream_buffer)
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, list(prompt_token_ids), params, priority, time.monotonic(),
                                   grammar, embed, images))
        if grammar is not None and not grammar.done():
            grammar.add_done_callback(lambda _f: self._wake.set())
        self._wake.set()
        return stream

    async def embed(self, token_ids: list[int], normalize: bool = True, pooling: str | None = None,
                    dimensions: int | None = None, priority: Priority = Priority.INTERACTIVE) -> list[float]:
        """The pooled final hidden states of token_ids (the model's own pooling unless `pooling` is given).

        The prompt runs through the scheduler as a prefill-only sequence under the same token budget as generation
        (chunked like any prompt); its blocks are freed when it finishes. Raises InvalidRequest / QueueFull /
        EngineDead as submit() does, and RuntimeError when the engine failed it; cancelling aborts it."""
        params = EmbedParams(pooling or self.engine.loaded.config.pooling, normalize, dimensions)
        stream = self.submit(token_ids, SamplingParams(max_tokens=1), priority, embed=params)
        try:
            async for out in stream:
                if out.error:
                    raise RuntimeError(out.error)
                if out.finished:
                    if out.embedding is None:
                        raise RuntimeError("the embedding request ended without a vector")
                    return out.embedding
        finally:
            stream.abort()  # a no-op once finished; a cancelled caller's request leaves the engine
        raise RuntimeError("the embedding request ended without a vector")

    async def compile_constraint(self, constraint: Constraint) -> None:
        """Compile a constraint off the event loop (cached for the submit that follows); raises ConstraintError when
        it is invalid, unsatisfiable, past a bound, or takes longer than COMPILE_TIMEOUT_S."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._grammar(constraint)), COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ConstraintError(f"the {constraint.kind} took longer than {COMPILE_TIMEOUT_S:.0f} s to compile; "
                                  "simplify it") from None

    def _grammar(self, constraint: Constraint) -> concurrent.futures.Future:
        """A future of the compiled grammar: done at once when cached, else compiling on the grammar threads."""
        cached = self.engine.grammars.cached(constraint)
        if cached is None:
            return self._compiler.submit(self.engine.grammars.compile, constraint)
        done: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(cached, CompiledGrammar):
            done.set_result(cached)
        else:
            done.set_exception(ConstraintError(str(cached), field=cached.field))
        return done

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._commands.append(("abort", request_id))
        self._wake.set()

    def prompt_progress(self, request_id: str) -> PromptProgress | None:
        """How far a request's prefill has come, read while the engine thread runs (Engine.prompt_progress); None
        before the engine thread takes the request in and after it ends."""
        return self.engine.prompt_progress(request_id)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats(), engine_alive=self.alive, engine_error=self.error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, message: str, reason: FinishReason = FinishReason.ABORT) -> None:
        for rid, stream in list(self._streams.items()):
            stream._put(RequestOutput(rid, [], "", finished=True, finish_reason=reason, error=message))
        self._streams.clear()

    # ---- the engine thread ------------------------------------------------------------------------------------
    def _drain_commands(self) -> list[RequestOutput]:
        with self._lock:
            commands = self._grammar_wait + list(self._commands)
            self._commands.clear()
        self._grammar_wait = []
        failed = []
        now = time.monotonic()
        for cmd in commands:
            if cmd[0] == "add":
                _, rid, prompt, params, priority, arrival, grammar, embed, images = cmd
                if grammar is not None and not grammar.done():
                    if now - arrival < COMPILE_TIMEOUT_S:
                        self._grammar_wait.append(cmd)  # not ready: the step loop goes on without it
                        continue
                    grammar.cancel()
                    grammar = ConstraintError(f"the {params.constraint.kind} took longer than "
                                              f"{COMPILE_TIMEOUT_S:.0f} s to compile; simplify it")
                try:
                    compiled = _compiled(grammar)
                    self.engine.add_request(rid, prompt, params, priority, arrival=arrival, grammar=compiled,
                                            embed=embed, images=images)
                except (InvalidRequest, QueueFull) as e:
                    failed.append(RequestOutput(rid, [], "", finished=True, finish_reason=FinishReason.ABORT,
                                                error=str(e)))
                finally:
                    with self._lock:
                        self._num_pending_adds -= 1
            elif any(w[1] == cmd[1] for w in self._grammar_wait):  # aborted while its grammar compiles
                self._grammar_wait = [w for w in self._grammar_wait if w[1] != cmd[1]]
                failed.append(RequestOutput(cmd[1], [], "", finished=True, finish_reason=FinishReason.ABORT))
                with self._lock:
                    self._num_pending_adds -= 1
            else:
                self.engine.abort(cmd[1])
        return failed

    def _run(self) -> None:
        engine = self.engine
        engine.use_threads()  # torch's and the C kernels' thread count are this thread's own
        idle = False
        while not self._stop.is_set():
            try:
                self._wake.clear()  # before draining: a command or compiled grammar arriving later still wakes us
                outputs = self._drain_commands()
                if engine.has_work():
                    idle = False
                    if self._turns is None:
                        outputs += engine.step()
                    else:
                        with self._turns.turn():
                            outputs += engine.step()
                elif not outputs:
                    if not idle:  # its OpenMP workers would keep another engine's from spinning (kernels/openmp.py)
                        engine.release_threads()
                        idle = True
                    self._wake.wait(IDLE_WAIT_S)  # a command, a compiled grammar or shutdown wakes it
                    continue
            except Exception as e:  # noqa: BLE001 - any failure must end the requests, not hang them
                log.exception("engine step failed")
                self._die(f"{type(e).__name__}: {e}")
                return
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
        # shutting down: release every request's blocks
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.step()

    def _die(self, message: str) -> None:
        self.error = message
        try:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            self.engine._pending_outputs.clear()
        except Exception:  # noqa: BLE001 - state may be broken; the error outputs below still go out
            log.exception("cleanup after engine failure failed")
        self._loop.call_soon_threadsafe(self._fail_all, f"engine error: {message}")


def _compiled(grammar: concurrent.futures.Future | ConstraintError | None) -> CompiledGrammar | None:
    """The compiled grammar of a finished compile; ConstraintError for any failure of it."""
    if grammar is None:
        return None
    if isinstance(grammar, ConstraintError):
        raise grammar
    try:
        return grammar.result(timeout=0)
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001 - a library failure is this request's error, not the engine's
        raise ConstraintError(f"the grammar failed to compile: {type(e).__name__}: {e}") from None
