"""`llmd serve`: the process lifecycle.

Listen first (TCP on loopback + a 0600 Unix socket), answer /health 503 while the model loads in a thread, then 200.
SIGTERM/SIGINT: stop accepting, give running streams `shutdown_grace` seconds, abort the rest, remove the socket file,
exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..config import usable_cores
from ..errors import LlmdError
from .app import configure_logging, create_app
from .core import ServerState
from .models import ModelManager
from .security import SecurityPolicy, is_loopback_host, read_key_file

if TYPE_CHECKING:
    from pathlib import Path

    from ..config import Settings
    from ..engine import Engine, EngineConfig
    from ..model.loader import LoadedModel
    from ..store import ModelFiles
    from .models import Served

log = logging.getLogger("llmd.server")

ABORT_SETTLE_S = 3.0  # after aborting, how long handlers get to send their last event


def model_threads(settings: Settings) -> int | None:
    """CPU threads each model computes with: --threads, else (model on the CPU) every core the process may use.

    Chosen by measurement: the bundled SmolLM2-135M Q4_1 on 2 otherwise idle cores, one streaming client on the same
    cores, a 2,009-token prompt then 64 tokens (`tests/benchmarks/bench_http.py --levels 1 --requests 1 --max-tokens
    64 --prompt-words 1950`, 8 alternating runs, medians): TTFT 4.6 s and 12.1 ms/token of decode with 2 threads,
    8.6 s and 20.1 ms/token with 1 (the old default, a core left to the HTTP server). The server's work between steps
    does not preempt the model's threads enough to matter; with other programs busy on the cores, fewer help."""
    if settings.threads:
        return settings.threads
    import torch

    on_cpu = (settings.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    return usable_cores() if on_cpu else None


def engine_config(settings: "Settings", **overrides: Any) -> "EngineConfig":
    """The one place settings become engine settings: every EngineConfig field that Settings has, by name (R6)."""
    from ..engine import EngineConfig

    values = {f.name: getattr(settings, f.name) for f in fields(EngineConfig) if hasattr(settings, f.name)}
    values["speculative_mode"] = settings.spec_mode or ("auto" if settings.draft_model else "off")
    values["seed"] = settings.seed or 0
    values["threads"] = model_threads(settings)
    values.update(overrides)
    return EngineConfig(**values)


def build_engine(settings: "Settings", files: "ModelFiles", kv_cache_bytes: int | None = None,
                 with_draft: bool = True) -> tuple["LoadedModel", "Engine"]:
    """Load one model and build its engine (in a worker thread: never on the event loop or an engine thread).
    A draft model (speculation) only serves the default model: it shares that model's tokenizer."""
    from ..engine import Engine
    from ..generate import torch_dtype
    from ..model.loader import load_model

    loaded = load_model(files, dtype=torch_dtype(settings.dtype), device=settings.device, quant=settings.quant)
    overrides: dict[str, Any] = {}
    if kv_cache_bytes is not None:  # the share; unless set, never less than one sequence at the full context
        useful, one_sequence = _useful_kv_bytes(settings, loaded)
        overrides["kv_cache_bytes"] = min(kv_cache_bytes, useful)
        if not settings.kv_cache_bytes:
            overrides["kv_cache_bytes"] = max(overrides["kv_cache_bytes"], one_sequence)
    if not with_draft:
        overrides["draft_model"] = None
        overrides["speculative_mode"] = "ngram" if settings.spec_mode == "ngram" else "off"
    return loaded, Engine(loaded, engine_config(settings, **overrides))


def _useful_kv_bytes(settings: "Settings", loaded: "LoadedModel") -> tuple[int, int]:
    """The most KV cache this model can use (every running sequence at its full context: a small model gets no bigger
    pool than that, leaving the memory budget to the others), and one sequence's at its full context (the least a
    pool must hold, or a request of max_model_len tokens would be refused). A hybrid's recurrent states take up to
    half of the budget (llmd.engine.runner.plan_states), so its figures are twice its KV's."""
    from ..engine.runner import kv_bytes_per_block
    from ..model.recurrent import state_bytes_per_sequence

    config = engine_config(settings).resolved(loaded.device.type, loaded.config.max_position_embeddings)
    per_block = kv_bytes_per_block(loaded.config, config.block_size, loaded.dtype, config.kv_cache_dtype)
    assert config.max_model_len is not None and config.max_num_seqs is not None  # resolved() fills them
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    share = 2 if state_bytes_per_sequence(loaded.config, loaded.dtype) else 1
    return share * per_block * blocks_per_seq * config.max_num_seqs, share * per_block * (blocks_per_seq + 1)


def load_served(entry: "Served", settings: "Settings", kv_cache_bytes: int, default: bool) -> tuple:
    """The model manager's loader: (engine, weight bytes on the device, KV pool bytes, on a GPU, weight bytes kept in
    host memory beside a GPU: llmd.model.host_table)."""
    from ..model.ops import release_cpu_threads

    assert entry.files is not None  # remote models have no loader
    try:
        loaded, engine = build_engine(settings, entry.files, kv_cache_bytes, with_draft=default)
    finally:
        release_cpu_threads()  # this thread's OpenMP workers would keep the engine thread's from spinning
    weights, host = (loaded.report.weight_bytes, loaded.report.host_bytes) if loaded.report is not None else (0, 0)
    return engine, weights - host, engine.runner.kv_cache_bytes, loaded.device.type == "cuda", host


def security_policy(settings: Settings) -> SecurityPolicy:
    api_key = settings.api_key
    if settings.api_key_file:
        api_key = read_key_file(settings.api_key_file)  # also refuses a key file others can read
    extra_hosts: frozenset[str] = frozenset()
    if not is_loopback_host(settings.host):
        if not api_key:
            raise LlmdError(f"refusing to listen on {settings.host} (not loopback) without an API key: "
                            "set LLMD_API_KEY or api_key_file")
        extra_hosts = frozenset({settings.host.lower()})
    return SecurityPolicy(api_key=api_key, origins=tuple(settings.origins), extra_hosts=extra_hosts)


def _prepare_socket_path(path: Path) -> None:
    """Make the socket's folder (0700 if we create it) and clear a stale socket; refuse if a daemon answers on it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not (path.exists() or path.is_symlink()):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # nobody listens: a leftover from a crash
        return
    finally:
        probe.close()
    raise LlmdError(f"another llmd is already serving on {path} (stop it with `llmd stop`)")


class Daemon:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.policy = security_policy(settings)
        self.socket_path = settings.resolved_socket_path()
        self.models = ModelManager(settings, load_served)
        self.state = ServerState(write_timeout=settings.write_timeout, keepalive_s=settings.stream_keepalive,
                                 shutdown_grace=settings.shutdown_grace, max_body_bytes=settings.max_body_bytes,
                                 models=self.models)
        self.stop_requested = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.sites: list[web.BaseSite] = []
        self.exit_code = 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        app = create_app(self.state, self.policy)
        # handler_cancellation: a client that disconnects cancels its handler, whose exit aborts the engine request
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=ABORT_SETTLE_S)
        await self.runner.setup()
        try:
            await self._listen()
            load = asyncio.create_task(self._load())
            await self.stop_requested.wait()
            if not load.done():
                load.cancel()  # the loading thread cannot be interrupted; we exit without waiting for it
            await self._drain()
        finally:
            await self.runner.cleanup()
            await self.models.shutdown()
            if self.socket_path is not None:
                self.socket_path.unlink(missing_ok=True)
        log.info("stopped")
        return self.exit_code

    async def _listen(self) -> None:
        s = self.settings
        assert self.runner is not None
        targets = [("tcp", s.host, s.port)]
        if s.ollama_port:
            targets.append(("tcp", s.host, s.ollama_port))
        for _, host, port in targets:
            site = web.TCPSite(self.runner, host, port, reuse_address=True)
            try:
                await site.start()
            except OSError as exc:
                raise LlmdError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
            self.sites.append(site)
        where = [f"http://{s.host}:{s.port}"] + ([f"http://{s.host}:{s.ollama_port} (Ollama)"] if s.ollama_port else [])
        if self.socket_path is not None:
            _prepare_socket_path(self.socket_path)
            old = os.umask(0o177)  # the socket is created 0600: only this user may talk to the daemon
            try:
                unix = web.UnixSite(self.runner, str(self.socket_path))
                await unix.start()
            finally:
                os.umask(old)
            os.chmod(self.socket_path, 0o600)
            self.sites.append(unix)
            where.append(f"unix:{self.socket_path}")
        log.info("listening on %s (pid %d)", ", ".join(where), os.getpid())

    async def _load(self) -> None:
        """Load the pinned models (the model manager); a failure ends the daemon with one clear line."""
        from ..generate import set_threads

        threads = model_threads(self.settings)
        set_threads(threads)  # the loads and threads started later; each engine thread sets its own (use_threads)
        log.info("loading model %s", self.settings.model or "(bundled default)")
        try:
            await self.models.start()
        except Exception as exc:  # noqa: BLE001 - any load failure ends the daemon with one clear line
            message = str(exc) if isinstance(exc, (LlmdError, ValueError)) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, (LlmdError, ValueError)):
                log.exception("model load failed")
            log.error("cannot load the model: %s", message)
            self.state.status, self.state.load_error = "failed", message
            self.exit_code = 1
            self.stop_requested.set()
            return
        st = self.state
        default = self.models.lookup(self.models.default_name or "")
        if default is not None:
            st.model_name, st.load_seconds = default.name, default.load_seconds
        st.status = "ready"
        on_cpu = default is None or not default.on_gpu
        log.info("ready: %s%s", ", ".join(e.name for e in self.models.loaded()),
                 f", {threads} CPU threads" if on_cpu and threads else "")

    async def _drain(self) -> None:
        st = self.state
        was_ready = st.status == "ready"
        st.status = "draining"
        for site in self.sites:
            await site.stop()  # stop accepting; open connections keep their running streams
        if not was_ready:
            return
        log.info("draining: %d running request(s), grace %.1fs", len(st.active), st.shutdown_grace)
        deadline = time.monotonic() + st.shutdown_grace
        while st.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if st.active:
            log.info("grace period over: aborting %d request(s)", len(st.active))
            for gen in list(st.active):
                gen.abort("shutdown")
            deadline = time.monotonic() + ABORT_SETTLE_S
            while st.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)


def serve(settings: Settings) -> int:
    """Run the daemon until SIGTERM/SIGINT; return the exit code."""
    configure_logging(getattr(logging, settings.log_level.upper()))
    daemon = Daemon(settings)
    return asyncio.run(daemon.run())
