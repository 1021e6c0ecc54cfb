"""Start a real `llmd serve` process for integration tests: free port, tmp Unix socket, XDG dirs in a tmp folder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LOAD_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llmd_exe() -> str:
    script = Path(sys.executable).parent / "llmd"
    return str(script) if script.exists() else "llmd"


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    port: int
    socket_path: Path
    log_path: Path
    env: dict
    api_key: str | None = None
    saw_loading: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get_json(self, path: str, timeout: float = 30.0) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, headers=self.headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def stats(self) -> dict:
        status, body = self.get_json("/v1/llmd/stats")
        assert status == 200, body
        return body

    def wait_idle(self, timeout: float = 120.0) -> dict:
        """Wait until no request runs or waits; return the stats then."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["requests_running"] == 0 and s["requests_waiting"] == 0:
                return s
            assert time.monotonic() < deadline, f"daemon not idle: {s}"
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def share_compiled_kernels(cache: Path) -> None:
    """The daemon's CPU kernels come from the test process's kernel cache: the same sources and flags name the same
    file, written atomically, so sharing changes nothing but the ~20 s each daemon would spend compiling them again."""
    from llmd.kernels.cpu_gemm import cache_dir

    shared, mine = cache_dir(), cache / "llmd" / "kernels"
    if not mine.exists():
        shared.mkdir(parents=True, exist_ok=True)
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.symlink_to(shared, target_is_directory=True)


def start_daemon(base: Path, *args: str, api_key: str | None = None, env: dict | None = None) -> DaemonProc:
    for sub in ("run", "config", "state", "data", "cache"):
        (base / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    share_compiled_kernels(base / "cache")
    extra = {"OLLAMA_MODELS": str(base / "ollama-models"), **(env or {})}  # never the user's Ollama store
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMD_")}
    env.update(extra)
    env = {k: v for k, v in env.items() if v is not None}  # env={"NAME": None}: the daemon goes without NAME
    env.update(XDG_RUNTIME_DIR=str(base / "run"), XDG_CONFIG_HOME=str(base / "config"),
               XDG_STATE_HOME=str(base / "state"), XDG_DATA_HOME=str(base / "data"),
               XDG_CACHE_HOME=str(base / "cache"), PYTHONUNBUFFERED="1")
    if api_key:
        env["LLMD_API_KEY"] = api_key
    port = free_port()
    sock = base / "run" / "llmd.sock"
    log_path = base / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([llmd_exe(), "serve", "--port", str(port), "--socket", str(sock), *args],
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    d = DaemonProc(proc, port, sock, log_path, env, api_key)
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llmd serve exited with {proc.returncode}:\n{d.log()}")
        try:
            with urllib.request.urlopen(d.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return d
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                d.saw_loading = True
        except OSError:
            pass
        if time.monotonic() > deadline:
            d.stop()
            raise RuntimeError(f"llmd serve did not become ready:\n{d.log()}")
        time.sleep(0.3)
