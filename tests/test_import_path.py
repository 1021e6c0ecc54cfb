"""The repository root is never on `sys.path`, in the test process or in any process the tests start.

Its `kernels/` folder (installed as `llmd.kernels`) would otherwise shadow Hugging Face's `kernels` package, which
transformers imports: the suite then fails far from the cause. `make test` runs the pytest entry point (which does
not add the working directory) with PYTHONSAFEPATH=1, and conftest.py sets PYTHONSAFEPATH for every subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIND_KERNELS = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"


def resolves_into_repo(origin: str) -> bool:
    """True when `kernels` was found as this repository's own folder (a venv inside the clone is fine)."""
    return bool(origin) and Path(origin).resolve().parent == REPO / "kernels"


def test_repository_root_is_not_on_sys_path():
    entries = {Path(p or os.getcwd()).resolve() for p in sys.path}
    assert REPO not in entries, f"{REPO} is on sys.path: run the suite with `make test` or `.venv/bin/pytest`"


def test_the_name_kernels_does_not_resolve_into_this_repository():
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is None or not resolves_into_repo(spec.origin or ""), spec.origin
    if spec is not None:  # Hugging Face's package, as transformers sees it
        import kernels

        assert hasattr(kernels, "get_kernel"), kernels.__file__


def test_subprocesses_started_in_the_repository_do_not_see_it_either():
    # `python -c` (and `-m`) would put the working directory first on sys.path, were it not for PYTHONSAFEPATH
    out = subprocess.run([sys.executable, "-c", FIND_KERNELS], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not resolves_into_repo(out.stdout.strip()), out.stdout
