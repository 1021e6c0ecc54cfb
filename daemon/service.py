"""`llmd service install|uninstall|status`: a systemd user unit made from packaging/llmd.service."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import LlmdError

UNIT_NAME = "llmd.service"
TEMPLATE = Path(__file__).resolve().parent.parent / "packaging" / UNIT_NAME


def unit_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME", "")
    base_dir = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return base_dir / "systemd" / "user" / UNIT_NAME


def exec_start() -> str:
    """How systemd should start llmd: the console script if it is on PATH, else this Python with the CLI module."""
    script = shutil.which("llmd")
    if script:
        return shlex.quote(str(Path(script).resolve()))
    return f"{shlex.quote(sys.executable)} -c 'from llmd.cli import main; main()'"


def render_unit() -> str:
    try:
        template = TEMPLATE.read_text(encoding="utf-8")
    except OSError:
        raise LlmdError(f"the unit template {TEMPLATE} is missing (install llmd from its source tree)") from None
    return template.replace("@EXEC_START@", exec_start())


def _systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess | None:
    if shutil.which("systemctl") is None:
        return None
    proc = subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LlmdError(f"systemctl --user {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def install(enable: bool = True) -> str:
    path = unit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_unit(), encoding="utf-8")
    lines = [f"wrote {path}"]
    if not enable:
        lines.append("start it with: systemctl --user daemon-reload && systemctl --user enable --now llmd")
        return "\n".join(lines)
    if _systemctl("daemon-reload") is None:
        lines.append("systemctl is not available here; enable the unit where systemd runs your user session")
        return "\n".join(lines)
    _systemctl("enable", "--now", UNIT_NAME)
    lines.append("enabled and started (logs: journalctl --user -u llmd -f)")
    return "\n".join(lines)


def uninstall() -> str:
    path = unit_path()
    if not path.exists():
        return f"not installed ({path} does not exist)"
    _systemctl("disable", "--now", UNIT_NAME, check=False)
    path.unlink()
    _systemctl("daemon-reload", check=False)
    return f"removed {path}"


def status() -> str:
    path = unit_path()
    if not path.exists():
        return f"not installed (run `llmd service install`; the unit would go to {path})"
    proc = _systemctl("status", "--no-pager", UNIT_NAME, check=False)
    if proc is None:
        return f"installed at {path}; systemctl is not available here"
    return f"installed at {path}\n" + (proc.stdout or proc.stderr).rstrip()
