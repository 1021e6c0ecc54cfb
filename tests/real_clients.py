"""Helpers for tests/test_real_clients.py: run a real client CLI in a scratch home, and read what it exchanged.

Each client runs with a fresh HOME and XDG folders under the test's tmp dir and an environment built from scratch
(PATH and the locale only, then the client's own lines), so nothing of the user's configuration or keys is read or
written. The client talks to a `RecordingProxy` in front of the daemon; a run is judged from its exit status, its
output, and the exchanges: the text llmd generated must be what the client printed.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recording_proxy import Exchange, RecordingProxy

ROOT = Path(__file__).resolve().parent.parent
CLIENTS_DIR = Path(os.environ.get("LLMD_CLIENTS_DIR") or ROOT / ".clients")
NPM_BIN = CLIENTS_DIR / "npm" / "node_modules" / ".bin"
RUN_TIMEOUT_S = 300.0
TAIL = 3000


def client_exe(name: str) -> Path:
    """A CLI that `make clients` installed: the npm ones, else the Python venvs' (`aider`, `llm`)."""
    for folder in (NPM_BIN, CLIENTS_DIR / "aider" / "bin", CLIENTS_DIR / "llm" / "bin"):
        if (folder / name).exists():
            return folder / name
    raise AssertionError(f"{name} is not installed under {CLIENTS_DIR}: run `make clients`")


@dataclass
class Run:
    argv: list[str]
    rc: int | None  # None: killed at the time box
    stdout: str
    stderr: str
    seconds: float
    exchanges: list[Exchange]
    log: str  # the daemon's log lines written during the run
    upstream: str  # the daemon, for replays
    refused: list[str] = field(default_factory=list)  # `refusals(run)`

    def report(self) -> str:
        ended = f"exit {self.rc}" if self.rc is not None else "killed at the time box"
        lines = [f"$ {' '.join(self.argv)}", f"{ended} after {self.seconds:.0f}s",
                 "--- stdout", self.stdout[-TAIL:], "--- stderr", self.stderr[-TAIL:], "--- exchanges"]
        lines += [ex.summary() for ex in self.exchanges] or ["(none: the client never reached llmd)"]
        lines += ["--- daemon log", self.log[-TAIL:]]
        if self.refused:
            lines += ["--- fields llmd refused (each request replayed, the named field dropped, until accepted)",
                      *self.refused]
        return "\n".join(lines)


def scratch_env(base: Path, extra: dict[str, str]) -> dict[str, str]:
    """HOME, XDG folders and a temp dir under `base`; PATH with node; nothing else of the caller's environment."""
    env = {"PATH": f"{NPM_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "LANG": "C.UTF-8",
           "HOME": str(base / "home"), "TMPDIR": str(base / "tmp"), "TERM": "dumb", "NO_COLOR": "1",
           "XDG_CONFIG_HOME": str(base / "home" / ".config"), "XDG_DATA_HOME": str(base / "home" / ".local/share"),
           "XDG_STATE_HOME": str(base / "home" / ".local/state"), "XDG_CACHE_HOME": str(base / "home" / ".cache")}
    for key in ("HOME", "TMPDIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    env.update(extra)
    return env


def run_client(argv: list[str], *, base: Path, env: dict[str, str], proxy: RecordingProxy, daemon_log: Path,
               timeout: float = RUN_TIMEOUT_S, cwd: Path | None = None) -> Run:
    """Run one client to its end or the time box (its whole process group killed then), stdin closed."""
    workdir = cwd or base / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    mark, log_at = proxy.mark(), daemon_log.stat().st_size
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=workdir, env=scratch_env(base, env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        rc = None
    seconds = time.monotonic() - started
    time.sleep(0.3)  # the last log line is written as the handler returns
    with open(daemon_log, "rb") as f:
        f.seek(log_at)
        log = f.read().decode(errors="replace")
    run = Run(argv, rc, out, err, seconds, proxy.since(mark), log, proxy.upstream)
    run.refused = refusals(run)
    return run


# --- What llmd answered -------------------------------------------------------------------------------------------

TEXT_KEYS = {"text", "content", "delta", "response", "output_text"}


def _texts(value: Any, key: str = "") -> list[str]:
    if isinstance(value, str):
        return [value] if key in TEXT_KEYS else []
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _texts(v, k)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v, key)]
    return []


def generated_text(ex: Exchange) -> str:
    """The text an answer carried, whichever the dialect and whether streamed (SSE `data:` lines, NDJSON) or not.
    Streamed events that repeat the whole text at the end (Responses' `response.completed`) are skipped."""
    pieces: list[str] = []
    for line in ex.response.splitlines() or [ex.response]:
        line = line.strip()
        if line.startswith("data:"):
            line = line[5:].strip()
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") in ("response.completed", "response.output_text.done",
                                                              "response.content_part.done",
                                                              "response.output_item.done"):
            continue
        pieces += _texts(event)
    return "".join(pieces)


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]{3,}", text.lower()))


def answered_by_llmd(run: Run, routes: tuple[str, ...]) -> str | None:
    """The text of the run's last answer (a 200 on one of `routes` that generated text) when the client printed it
    (at least half its words, or all of a text without words), else None. The last: an agent's side requests (a
    session title) come first."""
    answers = [text for ex in run.exchanges if ex.status == 200 and ex.path.split("?")[0].endswith(routes)
               and (text := generated_text(ex).strip())]
    if not answers:
        return None
    said, printed = words(answers[-1]), words(run.stdout)
    shown = len(said & printed) * 2 >= len(said) if said else answers[-1] in run.stdout
    return answers[-1] if shown else None


def logged_generations(run: Run, routes: tuple[str, ...]) -> list[str]:
    """The daemon's log lines of the run for generation requests on `routes` that answered 200 with tokens."""
    pattern = re.compile(r"POST (\S+) 200 .*gen=([1-9]\d*)")
    return [line for line in run.log.splitlines()
            if (m := pattern.search(line)) and m.group(1).split("?")[0].endswith(routes)]


def assert_answered(run: Run, routes: tuple[str, ...]) -> str:
    """The pass rule: exit 0, the daemon logged a generation on the client's route, and the client printed it."""
    assert run.rc == 0, run.report()
    assert logged_generations(run, routes), "llmd logged no generation for this client\n" + run.report()
    text = answered_by_llmd(run, routes)
    assert text is not None, "the client did not print what llmd generated\n" + run.report()
    return text


def assert_answered_or_too_long(run: Run, routes: tuple[str, ...], context: int) -> list[str]:
    """For a client's default prompt, which may not fit a small model: it answered (`assert_answered`), or every
    refusal was llmd's "the prompt has N tokens; the context holds `context`" and the client showed it. Returns
    those messages (empty when it answered)."""
    said = f"the context holds {context}"
    too_long = [ex for ex in run.exchanges if ex.status == 400 and said in ex.response]
    if not too_long or run.rc == 0:
        assert_answered(run, routes)
        return []
    others = [ex.summary() for ex in run.exchanges if ex.status >= 400 and ex not in too_long]
    assert not others, "llmd refused more than the length\n" + run.report()
    assert said in run.stdout + run.stderr, "the client did not show llmd's message\n" + run.report()
    return sorted({error_message(ex.response)[0] for ex in too_long})


# --- Which fields llmd refused ------------------------------------------------------------------------------------

FIELD_PATH = re.compile(r"^([A-Za-z_][\w-]*(?:\[\d+\]|\.[A-Za-z_][\w-]*)*)")


def _drop(body: Any, path: str) -> bool:
    """Delete the field at a path like `messages[0].content[1].cache_control`; False when it is not there."""
    steps = re.findall(r"\[(\d+)\]|\.?([A-Za-z_][\w-]*)", path)
    node = body
    for i, (index, name) in enumerate(steps):
        last = i == len(steps) - 1
        if index:
            if not isinstance(node, list) or int(index) >= len(node):
                return False
            if last:
                del node[int(index)]
                return True
            node = node[int(index)]
        else:
            if not isinstance(node, dict) or name not in node:
                return False
            if last:
                del node[name]
                return True
            node = node[name]
    return False


def error_message(text: str) -> tuple[str, str | None]:
    """The message and named parameter of an error body in any of llmd's dialects."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:300], None
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, str):
        return err, None
    if isinstance(err, dict):
        return str(err.get("message", err)), err.get("param")
    return str(err)[:300], None


def replay(upstream: str, ex: Exchange, body: Any, timeout: float = 120.0) -> tuple[int, str]:
    """Send a recorded request again with `body`; a 200 is hung up on at once (the daemon aborts it)."""
    host, port = upstream.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(ex.method, ex.path, body=json.dumps(body), headers={**ex.headers, "Content-Type":
                                                                          "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace") if resp.status >= 400 else ""
    finally:
        conn.close()


def refused_fields(upstream: str, ex: Exchange, limit: int = 16) -> list[str]:
    """Every field of a refused request that llmd names, in turn: replay it without each until it is accepted
    (the status line: a stream that fails later is not seen)."""
    if not isinstance(ex.body, dict) or ex.status not in (400, 422):
        return []
    body = json.loads(json.dumps(ex.body))
    status, text = ex.status, ex.response
    found: list[str] = []
    for _ in range(limit):
        message, param = error_message(text)
        # the field the message starts with (not a `param` that only says where, as a too-long prompt's does)
        m = FIELD_PATH.match(message)
        path = param if param and message.startswith(param) else m.group(1) if m else None
        if path and path.endswith(".type"):  # an item of a refused type (a tool, a block): drop the item
            path = path[:-len(".type")]
        found.append(f"{status} {message}")
        if status < 400 or path is None or not _drop(body, path):
            break
        status, text = replay(upstream, ex, body)
        if status < 400:
            found.append(f"accepted ({status}) once those fields are dropped")
            break
    return found


def refusals(run: Run) -> list[str]:
    """For each distinct refused request of a run (by path and body keys): the fields llmd refused in turn."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    out: list[str] = []
    for ex in run.exchanges:
        if ex.status not in (400, 422) or not isinstance(ex.body, dict):
            continue
        key = (ex.path, tuple(sorted(ex.body)))
        if key in seen:
            continue
        seen.add(key)
        out.append(f"{ex.method} {ex.path} (body keys: {', '.join(sorted(ex.body))}):")
        out += [f"  {line}" for line in refused_fields(run.upstream, ex)]
    return out


def describe_request(ex: Exchange) -> str:
    """What a generation request carried, in one paragraph: its top-level fields and the sizes that matter."""
    if not isinstance(ex.body, dict) or not ex.body:
        return f"{ex.method} {ex.path}"
    body = ex.body
    parts = [f"{ex.method} {ex.path} ({len(json.dumps(body))} bytes JSON) headers {ex.headers}"]
    for key, value in body.items():
        if key in ("messages", "input"):
            parts.append(f"  {key}: {len(value) if isinstance(value, list) else 1} item(s)")
        elif key == "tools":
            names = [t.get("name") or t.get("function", {}).get("name") or t.get("type") for t in value]
            parts.append(f"  tools: {len(value)} ({len(json.dumps(value))} bytes): {', '.join(map(str, names))}")
        elif key in ("system", "instructions"):
            parts.append(f"  {key}: {len(json.dumps(value))} bytes")
        else:
            text = json.dumps(value)
            parts.append(f"  {key}: {text if len(text) <= 200 else text[:200] + '...'}")
    return "\n".join(parts)
