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
