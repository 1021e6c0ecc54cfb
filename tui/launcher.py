"""Finding the daemon, and starting one in the background when none answers. Also the entry points of the
`llmd chat` and `llmd top` commands (kept here so the CLI stays thin and torch-free)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .client import DaemonClient, DaemonUnavailable, Endpoint


class DaemonStartFailed(Exception):
    pass


def make_client(url: str | None = None) -> DaemonClient:
    """A client for `url`, or for where the daemon's settings say it listens (socket first, then TCP)."""
    from llmd.config import load_settings

    settings = load_settings()  # a bad config is a ConfigError: one clear line from the CLI
    if url:
        return DaemonClient.for_url(url, api_key=settings.api_key)
    candidates = []
    socket_path = settings.resolved_socket_path()
    if socket_path is not None:
        candidates.append(Endpoint(socket_path=socket_path))
    candidates.append(Endpoint(host=_connect_host(settings.host), port=settings.port))
    return DaemonClient(candidates, api_key=settings.api_key)


def _connect_host(bind_host: str) -> str:
    # A daemon bound to every address is reached on loopback.
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host


def serve_argv(model: str | None = None) -> list[str]:
    """`llmd serve` with the same interpreter that runs this client (no PATH lookup)."""
    argv = [sys.executable, "-c", "from llmd.cli import main; main()", "serve"]
    if model:
        argv += ["--model", model]
    return argv


def daemon_log_path() -> Path:
    from llmd.config import state_dir

    return state_dir() / "daemon.log"


def spawn_daemon(argv: list[str], log_path: Path | None = None) -> subprocess.Popen:
    """Start the daemon detached from this terminal (its own session), logging to a file: it outlives the chat."""
    log_path = log_path or daemon_log_path()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def log_tail(log_path: Path, lines: int = 3) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


async def wait_until_ready(
    client: DaemonClient,
    proc: subprocess.Popen | None,
    on_status: Callable[[str, float], Any],
    timeout_s: float = 600.0,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Poll /health until the daemon says ok; report "starting"/"loading" with elapsed seconds on the way."""
    started = time.monotonic()
    while True:
        elapsed = time.monotonic() - started
        if proc is not None and proc.poll() is not None:
            tail = log_tail(log_path or daemon_log_path())
            raise DaemonStartFailed(f"llmd serve exited with code {proc.returncode}" + (f":\n{tail}" if tail else ""))
        if elapsed > timeout_s:
            raise DaemonStartFailed(f"the daemon was not ready after {timeout_s:.0f} s")
        try:
            health = await client.health()
        except DaemonUnavailable:
            await client.reset()
            on_status("starting", elapsed)
        else:
            if health.get("status") == "ok":
                return health
            on_status(str(health.get("status", "loading")), elapsed)
        await asyncio.sleep(0.25)


def run_chat(model: str | None = None, start: bool = False, url: str | None = None) -> None:
    from .chat_app import ChatApp
    from .store import ChatStore

    ChatApp(make_client(url), ChatStore(), model=model, auto_start=start).run()


def run_top(url: str | None = None) -> None:
    from .top_app import TopApp

    TopApp(make_client(url)).run()
