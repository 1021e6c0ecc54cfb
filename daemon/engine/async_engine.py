"""AsyncEngine: the engine loop in its own thread, with an asyncio front for the server.

The event loop never waits on the model: submit() validates at once and queues a command; the engine thread drains
commands before every step, runs the step, and hands the outputs back with call_soon_threadsafe. Each request reads
its outputs from a RequestStream whose buffer is bounded: when a slow reader lets it fill, new outputs are merged
into the last buffered one (tokens and text concatenated), so nothing is lost and nothing grows without limit.
If a step raises, every in-flight request ends with an error output, and the engine is marked dead (stats show
it, and submit raises EngineDead) rather than leaving requests hanging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque

from ..errors import EngineDead, InvalidRequest, QueueFull
from .engine import Engine
from .types import FinishReason, Priority, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

STREAM_BUFFER = 64
IDLE_WAIT_S = 0.5


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

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def loaded(self):
        return self.engine.loaded

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

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._fail_all("the engine shut down", FinishReason.ABORT)

    # ---- requests (event loop thread) -------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               priority: Priority = Priority.INTERACTIVE, request_id: str | None = None) -> RequestStream:
        if self.error is not None:
            raise EngineDead(f"the engine stopped after an internal error: {self.error}")
        if self._thread is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", field="request_id")
        self.engine.check_request(prompt_token_ids, params)
        with self._lock:
            # as Engine.add_request counts it: the adds not yet handed over wait only beyond the free running places
            scheduler = self.engine.scheduler
            if scheduler.num_waiting + self._num_pending_adds - scheduler.free_slots >= self.engine.config.max_queue:
                raise QueueFull(f"the queue is full ({self.engine.config.max_queue} requests waiting)")
            self._num_pending_adds += 1
            stream = RequestStream(request_id, self, self.stream_buffer)
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, list(prompt_token_ids), params, priority, time.monotonic()))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._commands.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        s = self.engine.stats()
        s["engine_alive"] = self.alive
        s["engine_error"] = self.error
        return s

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
            commands = list(self._commands)
            self._commands.clear()
        failed = []
        for cmd in commands:
            if cmd[0] == "add":
                _, rid, prompt, params, priority, arrival = cmd
                try:
                    self.engine.add_request(rid, prompt, params, priority, arrival=arrival)
                except (InvalidRequest, QueueFull) as e:
                    failed.append(RequestOutput(rid, [], "", finished=True, finish_reason=FinishReason.ABORT,
                                                error=str(e)))
                finally:
                    with self._lock:
                        self._num_pending_adds -= 1
            else:
                self.engine.abort(cmd[1])
        return failed

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                outputs = self._drain_commands()
                if engine.has_work():
                    outputs += engine.step()
                elif not outputs:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
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
