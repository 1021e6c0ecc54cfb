"""A model's digest as Ollama's API reports one (64 hex digits): clients such as the llm-ollama plugin tell models
apart by it, so two different models never share one and a model keeps its digest from one listing to the next.

- A model of Ollama's store: its manifest's sha256 (`ModelFiles.digest`), as `ollama list` prints it.
- Any other model: the sha256 of its weights: a GGUF file's bytes (what `sha256sum` prints); for a Hugging Face
  folder, the sha256 of the lines `<sha256 of the file>  <name>` of its weight files, sorted by name.
- Hashing gigabytes takes seconds to minutes, so no listing waits for it: each file is hashed once, in one background
  thread, and its hash kept in llmd's cache dir (`digests.json`) keyed by the file's real path, size and mtime (a
  changed file is hashed again). Until then the model's digest is a stand-in, the sha256 of those keys: stable while
  the files are unchanged and distinct per file; it changes once, to the content digest, when hashing finishes.
- A name made with /api/create or /api/copy (`llmd.store.created`): its base's digest when it adds no settings (a
  copy keeps the digest, as `ollama cp` does), else the sha256 of the base's digest and the settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from .files import ModelFiles

log = logging.getLogger("llmd.store")

CACHE_FILE = "digests.json"
MAX_CACHED = 4096  # file hashes kept on disk (the oldest are dropped)
CHUNK = 1 << 20

Key = tuple[str, int, int]  # (real path, size, mtime in ns)


def weight_files(files: ModelFiles) -> list[Path]:
    """The files whose bytes make the model: the .gguf file, or an HF folder's top-level safetensors shards."""
    if files.kind == "gguf":
        return [files.path]
    shards = sorted(files.path.glob("*.safetensors"))
    return shards or [files.path / "config.json"]


def _key(path: Path) -> Key:
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Digests:
    """File hashes, computed in one background thread and kept on disk. `of` never blocks on hashing."""

    def __init__(self, cache_file: Path | None = None):
        self._path = cache_file
        self._known: dict[str, str] | None = None  # "path\0size\0mtime" -> sha256 hex, loaded on first use
        self._pending: set[Key] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue[Key] = queue.Queue()
        self._worker: threading.Thread | None = None

    def of(self, files: ModelFiles) -> str:
        """The model's digest now: the content digest when its files are hashed, else the stand-in (and the
        hashing is queued)."""
        base = files.digest or self._weights_digest(files)
        created = files.created
        settings = created.settings() if created is not None else {}
        if not settings:
            return base
        return hashlib.sha256(f"{base}\0{json.dumps(settings, sort_keys=True)}".encode()).hexdigest()

    def settle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queued files to be hashed; True when none is left."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._queue.unfinished_tasks

    def _weights_digest(self, files: ModelFiles) -> str:
        paths = weight_files(files)
        try:
            keys = [_key(p) for p in paths]
        except OSError:  # a file gone since it was listed: a digest of its name, until it is back
            return hashlib.sha256(f"llmd-missing\0{files.path}".encode()).hexdigest()
        hashes = [self._hash(k) for k in keys]
        if any(h is None for h in hashes):
            return hashlib.sha256("\0".join(f"llmd-stand-in\0{r}\0{s}\0{m}" for r, s, m in keys).encode()).hexdigest()
        if files.kind == "gguf":
            return str(hashes[0])
        lines = "".join(f"{h}  {p.name}\n" for h, p in zip(hashes, paths, strict=True))  # sorted by name
        return hashlib.sha256(lines.encode()).hexdigest()

    def _hash(self, key: Key) -> str | None:
        with self._lock:
            known = self._load()
            found = known.get(_text(key))
            if found is None and key not in self._pending:
                self._pending.add(key)
                self._queue.put(key)
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work, name="llmd-digests", daemon=True)
                    self._worker.start()
            return found

    def _work(self) -> None:
        while True:
            key = self._queue.get()
            try:
                digest = _sha256_file(key[0])
                current = _key(Path(key[0]))
            except OSError as exc:
                log.warning("cannot hash %s: %s", key[0], exc.strerror)
                digest, current = None, None
            with self._lock:
                self._pending.discard(key)
                if digest is not None and current == key:  # unchanged while it was read
                    known = self._load()
                    known[_text(key)] = digest
                    while len(known) > MAX_CACHED:
                        del known[next(iter(known))]
                    self._save(known)
            self._queue.task_done()

    def _file(self) -> Path:
        if self._path is None:
            from ..config import cache_dir

            self._path = cache_dir() / CACHE_FILE
        return self._path

    def _load(self) -> dict[str, str]:
        if self._known is None:
            try:
                data = json.loads(self._file().read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
            self._known = {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} \
                if isinstance(data, dict) else {}
        return self._known

    def _save(self, known: dict[str, str]) -> None:
        path = self._file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(known), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:  # the hashes stay in memory; the next daemon hashes again
            log.warning("cannot write %s: %s", path, exc.strerror)


def _text(key: Key) -> str:
    return "\0".join(map(str, key))


DIGESTS = Digests()


def model_digest(files: ModelFiles) -> str:
    return DIGESTS.of(files)
