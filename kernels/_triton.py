"""Import Triton if it is there: the torch references and the CPU path must work without it."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a linux dependency
    triton = None
    tl = None
    HAVE_TRITON = False


def fastest(candidates, run, what: str) -> tuple[dict, dict]:
    """The (config, launch options) among `candidates` for which `run(config, launch)` is fastest on the device
    (autotune, timed once per shape by the caller's cache). A tiling that does not fit the device (shared memory,
    registers) is passed over; `what` names the shape in the error when none runs."""
    from triton.testing import do_bench

    best, best_ms = None, float("inf")
    for cfg, launch in candidates:
        try:
            ms = do_bench(lambda: run(cfg, launch), warmup=3, rep=10)
        except Exception:  # noqa: BLE001 - any failure to compile or launch rules the tiling out
            continue
        if ms < best_ms:
            best, best_ms = (cfg, launch), ms
    if best is None:
        raise RuntimeError(f"no {what} tiling runs")
    return best
