"""The OpenMP worker threads of the calling thread: hand them back when it stops computing for a while.

torch and the C kernels share one OpenMP runtime (libgomp, torch's copy: the kernels' library names the same
soname), and libgomp keeps one pool of worker threads for each thread that starts a parallel region. While the
process holds more pool threads than it has cores, every pool's workers stop spinning between parallel regions
and sleep on a futex instead (libgomp's throttled spin count), so each of a decode step's hundreds of parallel
regions pays a wake-up. A daemon that loads a model in one thread and steps it in another is over that line on
2 cores (the main thread and a worker in each pool): `llmd serve --threads 2` decoded SmolLM2 after a 2k-token
prompt at 17.6 ms a token, with about 300 voluntary context switches a token, and at 12.1 ms once the loading
thread handed its pool back (medians of 8 runs, tests/benchmarks/bench_http.py, see llmd.server.daemon).

So a thread that is done computing for a while (the model loader after the load, an engine thread going idle)
calls `release_pool()`; its next parallel region, if any, starts new workers (tens of microseconds).
"""

from __future__ import annotations

import ctypes
import os

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: stop the threads, keep the runtime
_libgomp: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _runtime() -> ctypes.CDLL | None:
    """libgomp as this process loaded it (torch's), or None: not loaded (another OpenMP, or none), or too old
    for omp_pause_resource_all (OpenMP 5.0, GCC 9)."""
    global _libgomp
    if _libgomp is False:
        try:
            lib = ctypes.CDLL("libgomp.so.1", mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            _libgomp = lib
        except (OSError, AttributeError):
            _libgomp = None
    return _libgomp or None


def release_pool() -> bool:
    """Stop the calling thread's OpenMP worker threads; True where they were handed back (or there were none)."""
    lib = _runtime()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
