"""Load generation: closed loop (N clients, each sends its next request when the last one ends) and open loop
(Poisson arrivals at R requests/s, independent of how fast the server answers), bounded in count and duration.

A run that meets a dead server stops early and keeps what it measured; the reason is kept in `RunResult.stopped`.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .client import BenchClient, BenchError, RequestResult
from .workloads import BenchRequest

# After this many failures in a row the server is taken as down (or broken) and the run stops.
MAX_CONSECUTIVE_ERRORS = 8
# Open loop: requests in flight at once, past which arrivals are dropped and counted (bounded memory and sockets).
MAX_IN_FLIGHT = 1024


@dataclass(frozen=True)
class LoadLevel:
    mode: str                      # "closed" or "open"
    concurrency: int = 1           # closed loop: clients
    rate: float = 0.0              # open loop: requests per second

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.mode == "closed" else f"r={self.rate:g}/s"

    @property
    def value(self) -> float:
        return float(self.concurrency) if self.mode == "closed" else self.rate


@dataclass
class RunResult:
    level: LoadLevel
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    stats_before: dict | None = None
    stats_after: dict | None = None
    stopped: str | None = None     # why the run ended early, if it did
    dropped: int = 0               # open loop arrivals not sent because MAX_IN_FLIGHT were in flight

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def failed(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]


class Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, label: str, total: int | None, duration_s: float | None, enabled: bool):
        self.label, self.total, self.duration_s, self.enabled = label, total, duration_s, enabled
        self.start = time.perf_counter()
        self.done = self.errors = 0
        self._last_draw = 0.0

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += 0 if result.ok else 1
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw > 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self.start
        fractions = []
        if self.total:
            fractions.append(self.done / self.total)
        if self.duration_s:
            fractions.append(elapsed / self.duration_s)
        frac = min(1.0, max(fractions)) if fractions else 0.0
        width = 24
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        rate = self.done / elapsed if elapsed > 0 else 0.0
        total = f"/{self.total}" if self.total else ""
        sys.stderr.write(f"\r{self.label:>10} [{bar}] {self.done}{total} req  {rate:5.1f} req/s  "
                         f"errors {self.errors}  {elapsed:5.1f}s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()


class _Stopper:
    """Tracks failures in a row; trips once the server looks down."""

    def __init__(self, limit: int):
        self.limit, self.streak, self.reason = limit, 0, None

    def record(self, result: RequestResult) -> None:
        if result.ok:
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.limit and self.reason is None:
            self.reason = f"stopped after {self.streak} failed requests in a row; last error: {result.error}"


async def run_level(client: BenchClient, workload: Sequence[BenchRequest], level: LoadLevel, *,
                    num_requests: int | None = None, duration_s: float | None = None, seed: int = 0,
                    progress: bool = False, max_consecutive_errors: int = MAX_CONSECUTIVE_ERRORS,
                    on_result: Callable[[RequestResult], None] | None = None,
                    stop: asyncio.Event | None = None) -> RunResult:
    """Run one load level. Requests are taken from `workload` in order (cycled); stops at `num_requests` sent or
    after `duration_s` (no new request starts after it; those in flight finish), whichever comes first."""
    if not workload:
        raise BenchError("the workload is empty")
    if num_requests is None and duration_s is None:
        num_requests = len(workload)
    if num_requests is not None and num_requests < 1:
        raise BenchError("--requests must be at least 1")
    if duration_s is not None and duration_s <= 0:
        raise BenchError("--duration must be positive")
    if level.mode == "closed" and not 1 <= level.concurrency <= MAX_IN_FLIGHT:
        raise BenchError(f"--concurrency must be between 1 and {MAX_IN_FLIGHT}")
    if level.mode == "open" and level.rate <= 0:
        raise BenchError("--rate must be positive")

    run = RunResult(level=level)
    run.stats_before = await client.llmd_stats() if client.is_llmd else None
    bar = Progress(level.label, num_requests, duration_s, progress)
    stopper = _Stopper(max_consecutive_errors)
    source = enumerate(itertools.cycle(workload))
    start = time.perf_counter()
    deadline = start + duration_s if duration_s else None

    def may_send(sent: int) -> bool:
        if stopper.reason is not None or (stop is not None and stop.is_set()):
            return False
        if num_requests is not None and sent >= num_requests:
            return False
        return deadline is None or time.perf_counter() < deadline

    def record(result: RequestResult) -> None:
        run.results.append(result)
        stopper.record(result)
        bar.update(result)
        if on_result:
            on_result(result)

    sent = 0
    try:
        if level.mode == "closed":
            async def worker() -> None:
                nonlocal sent
                while may_send(sent):
                    index, req = next(source)
                    sent += 1
                    record(await client.send(index, req))

            await asyncio.gather(*(worker() for _ in range(level.concurrency)))
        else:
            rng = random.Random(f"arrivals-{seed}-{level.rate}")
            in_flight: set[asyncio.Task] = set()

            async def one(index: int, req: BenchRequest) -> None:
                record(await client.send(index, req))

            next_at = start
            while may_send(sent):
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                    if not may_send(sent):
                        break
                index, req = next(source)
                sent += 1
                if len(in_flight) >= MAX_IN_FLIGHT:
                    run.dropped += 1
                else:
                    task = asyncio.ensure_future(one(index, req))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                next_at += rng.expovariate(level.rate)
            if in_flight:
                await asyncio.gather(*in_flight)
    finally:
        run.wall_s = time.perf_counter() - start
        bar.close()
    run.stopped = stopper.reason or ("interrupted" if stop is not None and stop.is_set() else None)
    run.results.sort(key=lambda r: r.sent_at)
    run.stats_after = await client.llmd_stats() if client.is_llmd else None
    return run


def parse_levels(text: str, *, integer: bool) -> list[float]:
    """`1,2,4,8` or `1..16` (doubling from the first to the last) -> the list of levels."""
    text = text.strip()
    try:
        if ".." in text:
            lo_text, hi_text = text.split("..", 1)
            lo, hi = float(lo_text), float(hi_text)
            if lo <= 0 or hi < lo:
                raise ValueError
            levels, x = [], lo
            while x <= hi * (1 + 1e-9) and len(levels) < 64:
                levels.append(x)
                x *= 2
            if levels[-1] < hi:
                levels.append(hi)
        else:
            levels = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BenchError(f"bad sweep {text!r}: give a list like 1,2,4,8 or a range like 1..16") from None
    if not levels or any(v <= 0 for v in levels):
        raise BenchError(f"bad sweep {text!r}: levels must be positive")
    if len(levels) > 64:
        raise BenchError(f"bad sweep {text!r}: at most 64 levels")
    if integer:
        if any(v != int(v) for v in levels):
            raise BenchError(f"bad sweep {text!r}: concurrency levels must be whole numbers")
        return [int(v) for v in levels]
    return levels


async def run_sweep(client: BenchClient, workload: Sequence[BenchRequest], levels: Sequence[LoadLevel], **kwargs
                    ) -> list[RunResult]:
    """Run each level in turn; a level that finds the server down ends the sweep (what was measured is kept)."""
    runs = []
    for level in levels:
        run = await run_level(client, workload, level, **kwargs)
        runs.append(run)
        if run.stopped and (not run.ok or run.stopped == "interrupted"):
            break
    return runs
