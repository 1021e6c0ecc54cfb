"""Client-side verbs around the daemon: `llmd ps`, `llmd stop`, `llmd run`. Plain http.client over the Unix socket
(or TCP when there is no socket), so these commands start fast and need no event loop."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import state_dir
from ..engine.types import EngineStats
from ..errors import LlmdError

if TYPE_CHECKING:
    from ..config import Settings

START_TIMEOUT_S = 300.0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class DaemonClient:
    def __init__(self, settings: Settings, timeout: float = 600.0):
        self.settings = settings
        self.timeout = timeout
        self.socket_path = settings.resolved_socket_path()
        self.started_pid: int | None = None  # set by ensure_daemon when it started the daemon

    def _connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        t = timeout or self.timeout
        if self.socket_path is not None and self.socket_path.exists():
            return _UnixConnection(str(self.socket_path), t)
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return http.client.HTTPConnection(host, self.settings.port, timeout=t)

    def where(self) -> str:
        if self.socket_path is not None and self.socket_path.exists():
            return f"unix:{self.socket_path}"
        return f"http://{self.settings.host}:{self.settings.port}"

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        conn = self._connection(timeout)
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            return conn, conn.getresponse()
        except OSError:
            conn.close()
            raise

    def get_json(self, path: str, timeout: float | None = None) -> tuple[int, dict]:
        conn, resp = self.request("GET", path, timeout=timeout)
        try:
            data = resp.read()
            return resp.status, json.loads(data or b"{}")
        finally:
            conn.close()

    def health(self) -> tuple[int, dict] | None:
        """(status, body) or None when no daemon answers."""
        try:
            return self.get_json("/health", timeout=5.0)
        except (OSError, ValueError):
            return None


def _error_message(body: dict) -> str:
    err = body.get("error")
    if isinstance(err, dict):
        return err.get("message", str(err))
    return str(err or body)


def ps(settings: Settings) -> str:
    client = DaemonClient(settings)
    if client.health() is None:
        raise LlmdError(f"no llmd daemon is running ({client.where()}); start one with `llmd serve`")
    status, stats = client.get_json("/v1/llmd/stats", timeout=10.0)
    if status != 200:
        raise LlmdError(_error_message(stats))
    lines = [f"daemon      pid {stats.get('pid')} on {client.where()}, up {stats.get('uptime_s', 0):.0f}s, "
             f"{stats.get('status')}, process RSS {_rss_mib(stats.get('pid'))}"]
    if stats.get("status") == "ready":
        budget = stats.get("memory_budget_bytes")
        models = stats.get("models") or []
        used = sum(m.get("size", 0) for m in models)
        if budget:
            lines.append(f"memory      {used / 2**20:.0f} MiB of the {budget / 2**20:.0f} MiB budget in use "
                         f"({len(models)} model(s) loaded)")
        for m in models:
            until = "forever (pinned)" if m.get("pinned") else "forever" if m["expires_at"].startswith("9999") \
                else f"until {m['expires_at'][:19].replace('T', ' ')} UTC"
            engine = EngineStats.from_dict(m.get("stats") or {})
            where = "GPU" if m.get("size_vram") else "CPU"
            if engine.threads:
                where += f", {engine.threads} thread{'' if engine.threads == 1 else 's'}"
            host = f" + {m['host_weight_bytes'] / 2**20:.0f} MiB in host memory" if m.get("host_weight_bytes") else ""
            lines.append(f"model       {m['name']} ({m.get('source')}, {where}, {m.get('size', 0) / 2**20:.0f} MiB{host}, "
                         f"{until})")
            lines += _engine_lines(engine)
        if not models:
            lines.append("model       none loaded (a request loads one on demand)")
    return "\n".join(lines)


def _engine_lines(s: EngineStats) -> list[str]:
    """One loaded model's KV cache (dtype, blocks, what 8k-token sequences fit) and requests, for `llmd ps`."""
    lines = []
    if s.kv is not None:
        kv = s.kv
        fits = ", ".join(f"{kind} {n}" for kind, n in kv.seqs_8k_by_dtype.items())
        n = kv.seqs_8k if kv.seqs_8k is not None else "?"
        lines += [
            f"  KV cache  {kv.dtype}, {kv.blocks_used}/{kv.blocks_total} blocks used ({kv.blocks_cached} cached for "
            f"reuse), {kv.tokens_total:,} tokens in {kv.cache_bytes / 2**20:.0f} MiB ({kv.bytes_per_token:,} "
            "bytes/token" + (f"; {kv.bytes_per_token_unshared:,} without KV sharing)"
                             if kv.bytes_per_token_unshared else ")"),
            f"  8k fits   {n} sequence{'' if n == 1 else 's'} of 8,192 tokens (by KV dtype: {fits})",
        ]
        if kv.state_slots is not None:  # a hybrid's recurrent layers: a fixed-size state per sequence
            lines.append(
                f"  states    {kv.state_slots_used}/{kv.state_slots} sequence slots of {kv.state_bytes_per_seq / 2**20:.1f}"
                f" MiB, {kv.state_checkpoints_cached}/{kv.state_checkpoints} prefix checkpoints "
                f"({kv.state_checkpoint_hits} hits), {kv.state_cache_bytes / 2**20:.0f} MiB")
    elif s.remote_url:
        lines.append(f"  remote    {s.remote_url} (its KV cache lives there)")
    hit = f", prefix-cache hit rate {100 * s.kv.prefix_hit_rate:.0f}%" if s.kv is not None else ""
    lines.append(f"  requests  {s.requests_running} running, {s.requests_waiting} waiting, {s.requests_finished_total} "
                 f"finished; {s.tokens_per_second:.1f} tok/s (recent){hit}")
    return lines


def _rss_mib(pid) -> str:
    try:
        with open(f"/proc/{int(pid)}/statm") as fh:
            pages = int(fh.read().split()[1])
        return f"{pages * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MiB"
    except (OSError, ValueError, TypeError):
        return "unknown"


def _owned_by_me(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it has exited)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError:
        return True


def stop(settings: Settings, timeout: float | None = None) -> str:
    """SIGTERM the daemon and wait for it to exit (its grace period plus a margin)."""
    client = DaemonClient(settings)
    if client.health() is None:
        raise LlmdError(f"no llmd daemon is running ({client.where()})")
    status, stats = client.get_json("/v1/llmd/stats", timeout=10.0)
    pid = stats.get("pid")
    if status != 200 or not isinstance(pid, int) or not _owned_by_me(pid):
        raise LlmdError(f"cannot find the daemon's process: {_error_message(stats) if status != 200 else pid}")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + (timeout or settings.shutdown_grace + 15.0)
    while time.monotonic() < deadline:
        if not _alive(pid):
            return f"stopped llmd (pid {pid})"
        time.sleep(0.1)
    raise LlmdError(f"llmd (pid {pid}) did not exit in time")


def ensure_daemon(settings: Settings, model: str | None) -> DaemonClient:
    """Return a client of a ready daemon, starting one in the background (logs in the state dir) if none runs."""
    client = DaemonClient(settings)
    answer = client.health()
    proc = None
    if answer is None:
        log_dir = state_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / "llmd.log"
        cmd = [sys.executable, "-c", "from llmd.cli import main; main()", "serve"]
        if model:
            cmd += ["--model", model]
        print(f"starting llmd (log: {log_path}) ...", file=sys.stderr)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        client.started_pid = proc.pid
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        answer = client.health()
        if answer is not None and answer[0] == 200:
            return client
        if answer is not None and answer[1].get("status") == "failed":
            raise LlmdError(f"the daemon could not load the model: {answer[1].get('error')}")
        if proc is not None and proc.poll() is not None:
            tail = _tail(state_dir() / "llmd.log")
            raise LlmdError(f"the daemon exited at start: {tail}")
        if time.monotonic() > deadline:
            raise LlmdError("the daemon did not become ready in time")
        time.sleep(0.2)


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(empty log)"
    except OSError:
        return "(no log)"


def chat_once(client: DaemonClient, model: str | None, messages: list[dict], out=sys.stdout, **options) -> str:
    """Stream one chat completion to `out`; return the full reply. options: temperature, max_tokens."""
    body = {"messages": messages, "stream": True, **{k: v for k, v in options.items() if v is not None}}
    if model:
        body["model"] = model
    conn, resp = client.request("POST", "/v1/chat/completions", body)
    try:
        if resp.status != 200:
            data = resp.read()
            try:
                raise LlmdError(_error_message(json.loads(data)))
            except ValueError:
                raise LlmdError(f"HTTP {resp.status}: {data[:200]!r}") from None
        parts = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise LlmdError(_error_message(event))
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text:
                    parts.append(text)
                    out.write(text)
                    out.flush()
        out.write("\n")
        return "".join(parts)
    finally:
        conn.close()


def _request_name(model: str | None, started: bool) -> str | None:
    """The model name to send. A request never names a file: a daemon started here with a path serves it as its
    default (no name); a daemon already running must be given a name."""
    from ..store import BadModelName, check_name

    if model is None:
        return None
    try:
        return check_name(model)
    except BadModelName:
        if started:
            return None
        raise LlmdError(f"{model} is a file, and the running daemon serves models by name (llmd list shows them); "
                        f"to serve this file, stop it (llmd stop) and run again, or start `llmd serve --model {model}`"
                        ) from None


def user_message(text: str, images: list[Path]) -> dict:
    """A user turn, with its images (files, sent as data URIs) before the text."""
    if not images:
        return {"role": "user", "content": text}
    parts = []
    for path in images:
        try:
            data = base64.b64encode(Path(path).read_bytes()).decode()
        except OSError as exc:
            raise LlmdError(f"cannot read image {path}: {exc.strerror}") from None
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/*;base64,{data}"}})
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def run(settings: Settings, model: str | None, prompt: str | None, images: list[Path] | None = None,
        **options: float | int | None) -> None:
    """`llmd run MODEL [PROMPT] [--image PATH]`: one-shot, or a simple prompt loop on a terminal (stdin is read when
    piped); images go with the first prompt."""
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise LlmdError("no prompt: give one as an argument or on stdin")
    client = ensure_daemon(settings, model)
    model = _request_name(model, started=client.started_pid is not None)
    if prompt is not None:
        chat_once(client, model, [user_message(prompt, images or [])], **options)
        if client.started_pid is not None:
            print(f"llmd keeps serving in the background (pid {client.started_pid}, {client.where()}); "
                  "`llmd ps` shows it, `llmd stop` stops it", file=sys.stderr)
        return
    history: list[dict] = []
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() in ("/bye", "/exit", "/quit"):
            return
        if not line.strip():
            continue
        history.append(user_message(line, [] if history else images or []))
        history.append({"role": "assistant", "content": chat_once(client, model, history, **options)})
