"""Turns at the CPU: the engines of one process that compute on the CPU take their steps one at a time, in FIFO order.

Two models in one daemon each have an engine thread, and each step fans out over every core (torch's intra-op
threads, the C kernels' OpenMP threads). Run at once, two steps oversubscribe the cores (OpenMP threads spin while
they wait for each other) and neither knows how long the other will hold them: model B's prefill could crawl for the
whole of model A's long answer. Taken in turns, each step has every core, and a step that asks waits for at most the
step in progress and the ones asked before it: with two busy models, B's prefill waits at most one of A's steps, then
A's next step waits for it. A plain lock would not do: the thread that releases it usually takes it again at once.

The rule for devices: only engines whose model computes on the CPU take turns (`turns_for`). A CUDA engine's step
mostly queues kernels on the GPU, which interleaves two engines' work by itself; serializing them would leave the GPU
idle during each engine's host-side work (scheduling, sampling, detokenizing). Turns change when a step runs, never
what it computes: outputs are the same.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator


class StepTurns:
    """A fair (ticket) lock: `with turns.turn(): step()` runs steps one at a time, in the order they asked."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self.turns_total = 0
        self.waited_s_total = 0.0  # time spent waiting for another engine's step

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            if self._serving != ticket:
                asked = time.monotonic()
                while self._serving != ticket:
                    self._cond.wait()
                self.waited_s_total += time.monotonic() - asked
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self.turns_total += 1
                self._cond.notify_all()


CPU_TURNS = StepTurns()  # one per process: the cores are shared by every CPU engine in it


def turns_for(device_type: str) -> StepTurns | None:
    """The turns an engine on this device takes: the process's CPU turns, or none (CUDA: see the module doc)."""
    return CPU_TURNS if device_type == "cpu" else None
