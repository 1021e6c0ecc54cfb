"""The model manager: which models are loaded, loading on demand, keep-alive and eviction under a memory budget.

A request names a model; `ModelManager.acquire` finds it (a loaded model's names, a [models.NAME] of the config, then
the stores through `llmd.store.resolve_name`, which never opens a path from a request), loads it if needed and
returns its `Served` entry, counted as in use until the request's handler returns (`release`, from the app's
middleware). Rules, in the order the code applies them:

- Loading runs in a worker thread (never on the event loop, never on an engine thread): loaded models keep serving.
  One load at a time; requests for a model that is loading wait on that one load. A load that fails fails those
  requests with the loader's message and leaves no entry, so the next request tries again.
- Before a load, its footprint is estimated (weights from the file headers + the KV pool it will get) and room is
  made: idle models (no request in flight, not pinned) are evicted least recently used first, until the footprints
  fit the memory budget and the count fits `max_loaded_models`. A model bigger than the budget alone is a 507 that
  names the numbers; when busy or pinned models hold the room, the request waits for one to go idle (then 503).
- The KV budget is split: each model's pool is `kv_cache_bytes` when set, else its share of the budget
  (budget / max_loaded_models, less its weights), between KV_MIN_BYTES and the engine's device default.
- Keep-alive follows Ollama: every request sets its model's keep-alive (its `keep_alive`, else the default); the
  clock starts when the model's last request ends; 0 unloads it then; negative keeps it forever. Pinned models
  (`llmd serve --model A --model B`) never expire and are never evicted.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config import parse_keep_alive
from ..engine.types import DTYPE_NAMES
from ..errors import LlmdError, ModelNotFound
from .validation import ApiError

if TYPE_CHECKING:
    from ..config import Settings
    from ..engine.types import EngineStats
    from ..store import Created, ModelFiles, ModelInfo

log = logging.getLogger("llmd.server")

KV_MIN_BYTES = 32 * 1024**2
CPU_KV_DEFAULT_BYTES = 512 * 1024**2  # the engine's CPU default (llmd.engine.config.CPU_KV_CACHE_BYTES)
CUDA_KV_DEFAULT_BYTES = 8 * 1024**3
ROOM_WAIT_S = 60.0  # how long a load waits for busy models to go idle before a 503
REAPER_INTERVAL_S = 0.5
RETRY_AFTER_S = 2


@dataclass
class Served:
    """One model known to the manager: loading, then ready (a failed load leaves no entry)."""

    name: str  # the canonical name, as /api/ps shows it
    files: "ModelFiles | None"  # None for a remote model
    source: str  # bundled | hf-cache | ollama | path | config | remote
    real_path: str | None = None  # the files' real path: one entry per file
    pinned: bool = False
    remote: dict | None = None  # a [models.NAME] table with a url
    options: dict = field(default_factory=dict)  # default request options (an Ollama params layer)
    aliases: set[str] = field(default_factory=set)
    engine: Any = None  # an AsyncEngine, or a RemoteEngine, once ready
    info: "ModelInfo | None" = None
    status: str = "loading"
    weight_bytes: int = 0  # on the device (what the memory budget counts)
    kv_bytes: int = 0
    host_bytes: int = 0  # weights kept in host memory beside a GPU (llmd.model.host_table), outside the budget
    on_gpu: bool = False
    keep_alive: float | None = None  # seconds once idle; None: forever
    idle_since: float | None = None  # monotonic; None while a request is in flight
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0
    loaded_at: float = 0.0  # wall clock
    load_seconds: float = 0.0
    ready: asyncio.Future | None = None

    @property
    def size_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def expires_at(self, now: float | None = None) -> float | None:
        """Wall-clock time this model unloads if nothing uses it; None: never."""
        if self.pinned or self.keep_alive is None:
            return None
        now_mono = time.monotonic() if now is None else now
        start = self.idle_since if self.idle_since is not None else now_mono
        return time.time() + (start + self.keep_alive - now_mono)


def iso_time(wall: float | None) -> str:
    if wall is None:
        return "9999-12-31T23:59:59Z"  # what clients of Ollama read as "never"
    return datetime.fromtimestamp(wall, timezone.utc).isoformat().replace("+00:00", "Z")


def default_memory_budget(device: str | None) -> tuple[int, bool]:
    """(bytes, on_gpu): 90% of the GPU's memory on CUDA, else 75% of the machine's RAM."""
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        _free, total = torch.cuda.mem_get_info(torch.device(device or "cuda"))
        return int(total * 0.9), True
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.75), False


def estimate_weight_bytes(info: "ModelInfo", settings: "Settings", on_gpu: bool) -> int:
    """Resident weight bytes, from the file headers: a GGUF stays packed (llmd.model.gguf keeps it within 1.15x of
    the file), an HF checkpoint is converted to the compute dtype or the chosen quantization."""
    params = info.parameters or 0
    quant = settings.quant or "auto"
    if info.files.kind == "gguf" and quant in ("auto", "gguf"):
        return int(info.size_bytes * 1.15)
    if quant.startswith("int4") or quant == "bnb-nf4":
        per = 0.6
    elif quant in ("int8", "bnb-int8"):
        per = 1.1
    else:
        half = DTYPE_NAMES.get(settings.dtype or "") in ("bfloat16", "float16")
        per = 2 if (half or (on_gpu and not settings.dtype)) else 4
    return int(params * per) or info.size_bytes


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class ModelManager:
    def __init__(self, settings: "Settings", load: Callable[..., tuple]):
        self.settings = settings
        self.default_keep_alive = parse_keep_alive(settings.keep_alive)
        self.max_loaded = settings.max_loaded_models
        self.budget_bytes: int = settings.memory_budget or 0  # filled in by start() when not configured
        self.on_gpu = False
        # (Served, Settings, kv_bytes, is_default) -> (Engine, weight bytes on the device, KV bytes, on a GPU, weight
        # bytes in host memory beside a GPU); in a worker thread
        self._load = load
        self._models: dict[str, Served] = {}  # canonical name -> entry
        self._names: dict[str, str] = {}  # every name a request may use -> canonical name
        self._unloading: list[Served] = []  # forgotten, still freeing their memory
        self._created: dict[str, Created] = {}  # names made with /api/create or /api/copy -> their defaults
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._reaper: asyncio.Task | None = None
        self.default_name: str | None = None
        self.last_name: str | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Size the budget, load the pinned models (the first is the default for requests naming none), then
        start expiring idle ones. A pinned model that fails to load raises LlmdError."""
        loop = asyncio.get_running_loop()
        budget, self.on_gpu = await loop.run_in_executor(None, default_memory_budget, self.settings.device)
        self.budget_bytes = self.settings.memory_budget or budget
        log.info("model manager: memory budget %s (%s), up to %d models, keep-alive %s", _mib(self.budget_bytes),
                 "GPU" if self.on_gpu else "RAM", self.max_loaded, self.settings.keep_alive)
        pinned = [self.settings.model] + list(self.settings.preload)
        for i, name in enumerate(pinned):
            entry = self._entry(await loop.run_in_executor(None, self._find_for_operator, name), name)
            entry.pinned = True
            if i == 0:
                self.default_name = entry.name
            try:
                await self._get_loaded(entry, requested=name)
            except ApiError as exc:
                raise LlmdError(exc.message) from None
        self._reaper = asyncio.create_task(self._expire_loop())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in list(self._models.values()):
            if entry.status == "ready":
                await self._unload(entry, "shutdown")

    # ---- requests ---------------------------------------------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive: Any = None) -> Served:
        """The named model, loaded and counted in use; release() it when the request is done. ApiError otherwise."""
        seconds: float | None = None
        if keep_alive is not None:
            try:
                seconds = parse_keep_alive(keep_alive)
            except ValueError as exc:
                raise ApiError(400, f"keep_alive {exc}", param="keep_alive") from None
        entry = self._current(await self._entry_for(name))
        if keep_alive is None:
            seconds = self._default_keep_alive(entry)
        entry.active += 1  # held from here: neither eviction nor expiry touches it while its load finishes
        entry.idle_since = None
        try:
            await self._get_loaded(entry, requested=name)
        except BaseException:
            entry.active -= 1
            raise
        entry.last_used = time.monotonic()
        entry.keep_alive = seconds
        self.last_name = entry.name
        return entry

    def release(self, entry: Served) -> None:
        entry.active = max(0, entry.active - 1)
        entry.last_used = time.monotonic()
        if entry.active == 0:
            entry.idle_since = entry.last_used
            if entry.keep_alive == 0 and not entry.pinned and entry.status == "ready":
                asyncio.get_running_loop().create_task(self._unload_if_idle(entry))
            asyncio.get_running_loop().create_task(self._notify())

    async def unload(self, name: str | None) -> Served | None:
        """Unload a model now (Ollama's keep_alive 0 with an empty prompt); it finishes its running requests first."""
        canonical = self._names.get(name or self.default_name or "")
        entry = self._models.get(canonical or "")
        if entry is None or entry.pinned:
            return entry
        entry.keep_alive = 0
        if entry.active == 0:
            await self._unload(entry, "keep_alive 0")
        return entry

    def loaded(self) -> list[Served]:
        return [e for e in self._models.values() if e.status == "ready"]

    def lookup(self, name: str) -> Served | None:
        """A loaded (or loading) model by any of its names; no store lookup."""
        canonical = self._names.get(name) or self._names.get(name.removesuffix(":latest"))
        return self._models.get(canonical) if canonical else None

    def created_for(self, name: str | None) -> Created | None:
        """The defaults of a name made with /api/create or /api/copy, as it resolved when it was last looked up."""
        from ..store.created import canonical_name

        key = canonical_name(name) if name else None
        return self._created.get(key) if key else None

    def forget_name(self, name: str) -> None:
        """Drop a name made with /api/create or /api/copy that was remade or deleted: the next request resolves it
        again. The model it named stays loaded under its other names."""
        from ..store.created import canonical_name

        key = canonical_name(name) or name
        self._created.pop(key, None)
        for alias in {name, key, key.removesuffix(":latest")}:
            entry = self._models.get(self._names.get(alias, ""))
            if entry is not None and alias != entry.name:
                del self._names[alias]
                entry.aliases.discard(alias)

    # ---- finding a model --------------------------------------------------------------------------------------
    async def find(self, name: str) -> Found:
        """What a request's model name resolves to (a config model, else the stores), without loading it; ApiError
        400 for a name that can never name a model, 404 for one that names none."""
        from ..store import BadModelName

        try:
            return await asyncio.get_running_loop().run_in_executor(None, self._find_for_request, name)
        except BadModelName as exc:
            raise ApiError(400, str(exc), param="model") from None
        except ModelNotFound as exc:
            raise ApiError(404, str(exc), param="model", kind="model_not_found") from None
        except LlmdError as exc:  # a store entry that cannot be read: its file and problem
            raise ApiError(404, f"model {name!r} cannot be served: {exc}", param="model",
                           kind="model_not_found") from None

    async def _entry_for(self, name: str | None) -> Served:
        if name is None or name == "":
            name = self.default_name or self.settings.model
            if name is None:
                raise ApiError(400, "model is required (this daemon has no default model)", param="model")
        if not isinstance(name, str):
            raise ApiError(400, "model must be a string", param="model")
        known = self.lookup(name)
        if known is not None:
            return known
        return self._entry(await self.find(name), name)

    def _find_for_request(self, name: str) -> Found:
        """(worker thread) A config model, else the stores: never a path."""
        from ..store import resolve_name

        base = name.removesuffix(":latest")
        key = name if name in self.settings.models else base if base in self.settings.models else None
        if key is not None:
            return self._configured(key)
        return _found(resolve_name(name))

    def _find_for_operator(self, name: str | None) -> Found:
        """(worker thread) A name from the command line: a config model, or anything `llmd.store.resolve` takes."""
        from ..store import resolve

        if name is not None and name in self.settings.models:
            return self._configured(name)
        found = _found(resolve(name))
        if name:
            found.names |= {name, Path(name).name, Path(name).stem}
        return found

    def _configured(self, name: str) -> Found:
        table = self.settings.models[name]
        if "url" in table:
            return Found(key=name, remote=table)
        from ..store import resolve

        return _found(resolve(table["path"]), key=name)

    def _entry(self, found: Found, requested: str | None) -> Served:
        """(event loop) The entry of what a name resolved to: one per file, so two names of one file share it."""
        if found.remote is not None:
            assert found.key is not None
            return self._known(Served(name=found.key, files=None, source="remote", remote=found.remote))
        assert found.files is not None
        created = found.files.created
        if created is not None and requested:
            self._created[created.name] = created
        for entry in self._models.values():
            if entry.real_path is not None and entry.real_path == found.real_path:
                entry.aliases |= found.names | ({requested} if requested else set())
                return entry
        files = replace(found.files, created=None)  # one entry per file; a created name's defaults are per name
        entry = Served(name=found.key or files.name, files=files, real_path=found.real_path,
                       source="config" if found.key else found.files.source, options=dict(found.files.options))
        entry.aliases |= found.names | ({requested} if requested else set())
        return self._known(entry)

    def _known(self, entry: Served) -> Served:
        existing = self._models.get(entry.name)
        return existing if existing is not None else entry

    def _register(self, entry: Served) -> None:
        self._models[entry.name] = entry
        for alias in entry.aliases | {entry.name}:
            self._names[alias] = entry.name

    def _forget(self, entry: Served) -> None:
        if self._models.get(entry.name) is entry:
            del self._models[entry.name]
        for alias in [a for a, n in self._names.items() if n == entry.name]:
            del self._names[alias]

    # ---- loading ----------------------------------------------------------------------------------------------
    def _current(self, entry: Served) -> Served:
        """The registered entry of that name (a name resolved while another request registered it)."""
        return self._models.get(entry.name, entry)

    async def _get_loaded(self, entry: Served, requested: str | None) -> Served:
        entry = self._current(entry)
        if entry.status == "ready":
            for alias in entry.aliases:
                self._names.setdefault(alias, entry.name)
            return entry
        if entry.ready is None:
            entry.ready = asyncio.get_running_loop().create_future()
            self._register(entry)
            asyncio.get_running_loop().create_task(self._load_entry(entry, entry.ready))
        await asyncio.shield(entry.ready)
        return entry

    async def _load_entry(self, entry: Served, ready: asyncio.Future) -> None:
        try:
            async with self._load_lock:
                await self._load_now(entry)
        except ApiError as exc:
            self._forget(entry)
            ready.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - the loader's message goes to the requests waiting for it
            self._forget(entry)
            message = str(exc) if isinstance(exc, (LlmdError, ValueError)) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, (LlmdError, ValueError)):
                log.exception("loading %s failed", entry.name)
            log.error("cannot load model %s: %s", entry.name, message)
            ready.set_exception(ApiError(503, f"model {entry.name!r} failed to load: {message}",
                                         kind="service_unavailable"))
        else:
            ready.set_result(entry)
        ready.exception()  # marks a failure as seen, should no request be left waiting for it

    async def _load_now(self, entry: Served) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        if entry.remote is not None:
            from .remote import RemoteEngine

            engine = RemoteEngine(entry.name, entry.remote)
            await engine.start()
            entry.engine, entry.status, entry.loaded_at = engine, "ready", time.time()
            entry.idle_since = time.monotonic() if entry.active == 0 else None
            entry.keep_alive = self._default_keep_alive(entry)
            log.info("model %s: remote, at %s", entry.name, entry.remote["url"])
            return
        from ..store import describe

        assert entry.files is not None  # a local model
        info = await loop.run_in_executor(None, describe, entry.files)
        weights = estimate_weight_bytes(info, self.settings, self.on_gpu)
        kv = self._kv_bytes_for(weights)
        await self._make_room(entry, weights + kv)
        entry.weight_bytes, entry.kv_bytes, entry.info = weights, kv, info  # reserved while loading
        log.info("loading model %s (%s, ~%s weights + %s KV)", entry.name, entry.source, _mib(weights), _mib(kv))
        engine, weight_bytes, kv_bytes, on_gpu, host_bytes = await loop.run_in_executor(
            None, self._load, entry, self.settings, kv, entry.name == self.default_name)
        from ..engine import AsyncEngine

        async_engine = AsyncEngine(engine)
        async_engine.start()
        entry.engine, entry.weight_bytes, entry.kv_bytes, entry.on_gpu = async_engine, weight_bytes, kv_bytes, on_gpu
        entry.host_bytes = host_bytes
        entry.aliases.add(engine.loaded.name)
        for alias in entry.aliases:
            self._names.setdefault(alias, entry.name)
        entry.status, entry.loaded_at, entry.load_seconds = "ready", time.time(), time.monotonic() - started
        entry.idle_since = time.monotonic() if entry.active == 0 else None
        entry.keep_alive = self._default_keep_alive(entry)
        log.info("model %s ready in %.1fs (%s weights + %s KV)", entry.name, entry.load_seconds,
                 _mib(weight_bytes), _mib(kv_bytes))

    def _default_keep_alive(self, entry: Served) -> float | None:
        """A [models.NAME] keep_alive of the config, else the daemon's (checked when the settings load)."""
        table = self.settings.models.get(entry.name) if entry.source in ("config", "remote") else None
        if table is not None and "keep_alive" in table:
            return parse_keep_alive(table["keep_alive"])
        return self.default_keep_alive

    def _kv_bytes_for(self, weights: int) -> int:
        if self.settings.kv_cache_bytes:
            return self.settings.kv_cache_bytes
        cap = CUDA_KV_DEFAULT_BYTES if self.on_gpu else CPU_KV_DEFAULT_BYTES
        share = self.budget_bytes // self.max_loaded - weights
        return int(min(cap, max(KV_MIN_BYTES, share)))

    def _resident(self, other_than: Served) -> list[Served]:
        """What holds memory: ready models, the one reserved while loading, and those still shutting down."""
        held = [e for e in self._models.values() if e is not other_than and e.remote is None
                and (e.status == "ready" or e.weight_bytes)]
        return held + [e for e in self._unloading if e is not other_than]

    async def _make_room(self, entry: Served, need: int) -> None:
        if need > self.budget_bytes:
            raise ApiError(507, f"model {entry.name!r} needs about {_mib(need)} (weights + KV cache) but the memory "
                                f"budget is {_mib(self.budget_bytes)}; raise --memory-budget or use a smaller model",
                           kind="insufficient_storage")
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            resident = self._resident(entry)
            used = sum(e.size_bytes for e in resident)
            if used + need <= self.budget_bytes and len(resident) < self.max_loaded:
                return
            idle = sorted((e for e in resident if e.status == "ready" and e.active == 0 and not e.pinned),
                          key=lambda e: e.last_used)
            if idle:
                await self._unload(idle[0], f"evicted (least recently used) to make room for {entry.name}")
                continue
            pinned = sum(e.size_bytes for e in resident if e.pinned)
            if pinned + need > self.budget_bytes or sum(e.pinned for e in resident) >= self.max_loaded:
                raise ApiError(507, f"model {entry.name!r} needs about {_mib(need)}; pinned models hold "
                                    f"{_mib(pinned)} of the {_mib(self.budget_bytes)} budget "
                                    f"({len(resident)} of {self.max_loaded} model places)",
                               kind="insufficient_storage")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApiError(503, f"no room for model {entry.name!r}: the loaded models are busy ({_mib(used)} of "
                                    f"{_mib(self.budget_bytes)} in use); retry shortly", kind="service_unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---- unloading --------------------------------------------------------------------------------------------
    async def _unload_if_idle(self, entry: Served) -> None:
        if entry.active == 0 and entry.status == "ready" and not entry.pinned:
            await self._unload(entry, "keep_alive 0")

    async def _unload(self, entry: Served, why: str) -> None:
        if entry.status != "ready":
            return
        entry.status = "unloading"
        self._forget(entry)
        self._unloading.append(entry)
        try:
            engine, entry.engine = entry.engine, None
            await engine.shutdown()
            del engine
            await asyncio.get_running_loop().run_in_executor(None, _free_memory, entry.on_gpu)
        finally:
            self._unloading.remove(entry)
        log.info("unloaded model %s (%s)", entry.name, why)
        await self._notify()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now = time.monotonic()
            for entry in list(self._models.values()):
                if (entry.status == "ready" and not entry.pinned and entry.active == 0 and entry.keep_alive is not None
                        and entry.idle_since is not None and now - entry.idle_since >= entry.keep_alive):
                    try:
                        await self._unload(entry, f"keep-alive of {entry.keep_alive:g}s expired")
                    except Exception:  # noqa: BLE001 - one failed unload must not stop the expiry of the others
                        log.exception("unloading %s failed", entry.name)

    # ---- reports ----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The /v1/llmd/stats model part (the schema: tui/top_app.py): one entry per loaded model under `models`, with
        its engine's stats; at the top, for readers of one model, the most recently used model's stats with the
        request counts summed over all loaded models."""
        loaded = self.loaded()
        per = {e.name: e.engine.stats() for e in loaded}
        primary = self.last_name if self.last_name in per else self.default_name if self.default_name in per else \
            next(iter(per), None)
        out = asdict(per[primary]) if primary else {}
        out["requests_running"] = sum(s.requests_running for s in per.values())
        out["requests_waiting"] = sum(s.requests_waiting for s in per.values())
        out["model"] = primary or (self.default_name or "")
        out["models"] = [self.describe(e, per[e.name]) for e in loaded]
        out["memory_budget_bytes"] = self.budget_bytes
        return out

    def describe(self, e: Served, stats: EngineStats | None = None) -> dict:
        return {"name": e.name, "source": e.source, "pinned": e.pinned, "size": e.size_bytes,
                "weight_bytes": e.weight_bytes, "kv_cache_bytes": e.kv_bytes, "host_weight_bytes": e.host_bytes,
                "size_vram": e.size_bytes if e.on_gpu else 0, "expires_at": iso_time(e.expires_at()),
                "active_requests": e.active, "load_seconds": round(e.load_seconds, 3),
                "stats": asdict(stats if stats is not None else e.engine.stats())}


@dataclass
class Found:
    """What a name resolved to, worked out in a worker thread (file system reads) for the event loop to use."""

    key: str | None = None  # a [models.NAME] of the config
    files: "ModelFiles | None" = None
    remote: dict | None = None
    real_path: str | None = None
    names: set[str] = field(default_factory=set)  # the names the files answer to


def _found(files: "ModelFiles", key: str | None = None) -> Found:
    return Found(key=key, files=files, real_path=str(Path(files.path).resolve()),
                 names=_short_names(files) | ({key} if key else set()))


def _short_names(files: "ModelFiles") -> set[str]:
    """The alias and repo id a served file answers to, as a client would load it: the bundled default answers to
    `smollm2:135m` and its repo id until that repo is pulled (a name that resolves elsewhere is left out)."""
    from ..store import resolve_name
    from ..store.aliases import alias_for_repo
    from ..store.bundled import BUNDLED_REPO_ID

    repos = {r for r in (files.repo_id, BUNDLED_REPO_ID if files.source == "bundled" else None) if r}
    candidates = {n for repo in repos for n in (repo, alias_for_repo(repo)) if n}
    served = Path(files.path).resolve()
    names = {files.name}
    if files.source == "path":
        names |= {Path(files.path).name, Path(files.path).stem}
    for name in candidates:
        try:
            if Path(resolve_name(name).path).resolve() == served:
                names.add(name)
        except LlmdError:
            pass
    return names


def _free_memory(on_gpu: bool) -> None:
    gc.collect()
    if on_gpu:
        import torch

        torch.cuda.empty_cache()
