"""The CPU step turns (llmd.engine.turns): steps run one at a time, in the order they asked, so a thread that
finishes a step and asks again waits behind the others (a plain lock lets it take the cores again at once)."""

from __future__ import annotations

import threading
import time

from llmd.engine.turns import CPU_TURNS, StepTurns, turns_for


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_turns_are_fifo_and_one_at_a_time():
    turns = StepTurns()
    order: list[str] = []
    inside = []
    release = threading.Event()

    def step(name: str, hold: threading.Event | None = None) -> None:
        with turns.turn():
            inside.append(name)
            assert len(inside) == 1, inside  # never two steps at once
            order.append(name)
            if hold is not None:
                hold.wait(10)
            inside.remove(name)

    first = threading.Thread(target=step, args=("a1", release))
    first.start()
    wait_until(lambda: order == ["a1"])
    waiters = []
    for name in ("b", "c", "d"):  # asked in this order while a1 holds the turn
        t = threading.Thread(target=step, args=(name,))
        t.start()
        waiters.append(t)
        wait_until(lambda: turns._next_ticket == len(waiters) + 1)

    def again() -> None:  # a1's engine finishes its step and asks for the next one
        first.join()
        step("a2")

    a2 = threading.Thread(target=again)
    a2.start()
    release.set()
    for t in [*waiters, a2]:
        t.join(10)
    assert order == ["a1", "b", "c", "d", "a2"]
    assert turns.turns_total == 5 and turns.waited_s_total > 0


def test_a_step_that_raises_passes_the_turn_on():
    turns = StepTurns()
    try:
        with turns.turn():
            raise ValueError("step failed")
    except ValueError:
        pass
    done = threading.Event()
    t = threading.Thread(target=lambda: (turns.turn().__enter__(), done.set()))
    t.start()
    assert done.wait(5)


def test_only_cpu_engines_take_turns():
    assert turns_for("cpu") is CPU_TURNS
    assert turns_for("cuda") is None
