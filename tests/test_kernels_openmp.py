"""llmd.kernels.openmp: a thread that ran a parallel region hands its OpenMP worker threads back (they end)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from llmd.kernels import openmp


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_thread_hands_its_openmp_workers_back():
    # torch's wheels bring libgomp (the C kernels link its soname): with another runtime release_pool would do nothing
    assert "libgomp" in Path("/proc/self/maps").read_text(), "torch's OpenMP runtime is not libgomp"
    seen: list = []

    def compute_then_release() -> None:
        torch.set_num_threads(3)
        torch.ones(1 << 22).mul_(2)  # one parallel region: this thread's pool gets 2 workers
        seen.append(os_threads())
        seen.append(openmp.release_pool())
        seen.append(os_threads())
        seen.append(openmp.release_pool())  # no pool left: nothing to do
        torch.ones(1 << 22).mul_(2)  # and the next parallel region starts new workers
        seen.append(os_threads())

    thread = threading.Thread(target=compute_then_release)
    thread.start()
    thread.join()
    with_pool, released, without, again, next_region = seen
    assert released and again and with_pool - without == 2 and next_region == with_pool, seen
