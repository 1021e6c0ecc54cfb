"""Ollama's model store, read in place and never written: `$OLLAMA_MODELS`, else `~/.ollama/models`.

Layout: `manifests/<host>/<namespace>/<model>/<tag>` holds a JSON manifest whose `layers` name blobs by digest and
media type; a blob lives at `blobs/sha256-<64 hex>`. The model layer (`application/vnd.ollama.image.model`) is a
GGUF file; the params layer (`...image.params`) is a JSON object of default options (stop, num_ctx, temperature, ...)
that apply under a request's own options, as Ollama applies them. The template layer is a Go template: llmd uses the
GGUF's own chat template instead.

A name is `[host/][namespace/]model[:tag]` (defaults registry.ollama.ai, library, latest). Every part is checked
against Ollama's own character set before it becomes a path, digests must be 64 hex digits, and a manifest or blob
whose real path leaves the store (a symlink pointing out) is refused: nothing outside the store is opened through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelFileError

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"  # a vision model's mmproj GGUF
MAX_MANIFEST_BYTES = 1 << 20
MAX_PARAMS_BYTES = 1 << 16

_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")  # a host may carry a port: checked apart
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}(:[0-9]{1,5})?$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")

# The params layer's keys that llmd applies, with their JSON types (Ollama's option names).
PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "stop": (list,), "num_ctx": (int,), "temperature": (int, float), "top_k": (int,), "top_p": (int, float),
    "min_p": (int, float), "repeat_penalty": (int, float), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "seed": (int,), "num_predict": (int,),
}


def ollama_models_dir() -> Path:
    explicit = os.environ.get("OLLAMA_MODELS")
    return Path(explicit).expanduser() if explicit else Path.home() / ".ollama" / "models"


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def short(self) -> str:
        """The name as `ollama list` prints it: `llama3.2:3b`, `user/model:tag`, `hf.co/org/model:tag`."""
        prefix = "" if self.host == DEFAULT_HOST else self.host + "/"
        if self.host != DEFAULT_HOST or self.namespace != DEFAULT_NAMESPACE:
            prefix += self.namespace + "/"
        return f"{prefix}{self.model}:{self.tag}"


def parse_name(name: str) -> OllamaName | None:
    """The parts of an Ollama model name, or None when it is not one (nothing here touches the filesystem)."""
    if not name or len(name) > 512 or ".." in name or "\\" in name or any(ord(c) < 32 for c in name):
        return None
    base, tag = name, DEFAULT_TAG
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        base, tag = name[: len(name) - len(last)] + last.split(":", 1)[0], last.split(":", 1)[1]
    parts = base.split("/")
    if len(parts) == 1:
        host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0]
    elif len(parts) == 2:
        host, namespace, model = DEFAULT_HOST, parts[0], parts[1]
    elif len(parts) == 3:
        host, namespace, model = parts
    else:
        return None
    if not (_HOST_RE.match(host) and _PART_RE.match(namespace) and _PART_RE.match(model) and _TAG_RE.match(tag)):
        return None
    return OllamaName(host.lower(), namespace.lower(), model.lower(), tag)


@dataclass
class OllamaModel:
    name: OllamaName
    gguf: Path  # the model layer's blob, inside the store
    size_bytes: int
    digest: str  # the model blob's sha256 hex
    params: dict = field(default_factory=dict)  # checked default options from the params layer
    manifest_digest: str = ""  # the manifest's sha256 hex: the model's digest in `ollama list` and /api/tags
    projector: Path | None = None  # a vision model's projector blob (an mmproj GGUF)


class OllamaStore:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else ollama_models_dir()

    def _inside(self, path: Path) -> Path:
        """The real path, if it stays inside the store; a symlink out of it is refused."""
        real = Path(os.path.realpath(path))
        root = Path(os.path.realpath(self.root))
        if real != root and root not in real.parents:
            raise ModelFileError(path, f"points outside Ollama's store ({root}); refused")
        return real

    def find(self, name: str) -> OllamaModel | None:
        """The model a name names in the store, None when the store has no such manifest."""
        parsed = parse_name(name)
        if parsed is None:
            return None
        manifest = self.root / "manifests" / parsed.host / parsed.namespace / parsed.model / parsed.tag
        if not manifest.is_file():
            return None
        return self._read(parsed, manifest)

    def list(self) -> list[OllamaModel]:
        """Every model in the store (an unreadable manifest is skipped: one bad entry must not hide the others)."""
        top = self.root / "manifests"
        found: list[OllamaModel] = []
        if not top.is_dir():
            return found
        for manifest in sorted(top.glob("*/*/*/*")):
            host, namespace, model, tag = manifest.relative_to(top).parts
            parsed = parse_name(f"{host}/{namespace}/{model}:{tag}")
            if parsed is None or not manifest.is_file():
                continue
            try:
                found.append(self._read(parsed, manifest))
            except ModelFileError:
                continue
        return found

    def _read(self, name: OllamaName, manifest: Path) -> OllamaModel:
        real = self._inside(manifest)
        raw = _read_limited(real, MAX_MANIFEST_BYTES, manifest)
        data = _parse_json(raw, manifest)
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise ModelFileError(manifest, "an Ollama manifest needs a list of layers")
        by_type: dict[str, dict] = {}
        for layer in layers:
            if isinstance(layer, dict) and isinstance(layer.get("mediaType"), str):
                by_type.setdefault(layer["mediaType"], layer)
        model_layer = by_type.get(MODEL_MEDIA_TYPE)
        if model_layer is None:
            kinds = ", ".join(sorted(by_type)) or "none"
            raise ModelFileError(manifest, f"no GGUF model layer ({MODEL_MEDIA_TYPE}); layers: {kinds}. llmd runs "
                                           "Ollama's GGUF models only")
        digest, blob = self._blob(model_layer, manifest)
        params: dict = {}
        if PARAMS_MEDIA_TYPE in by_type:
            _, params_blob = self._blob(by_type[PARAMS_MEDIA_TYPE], manifest)
            params = check_params(_read_json(params_blob, MAX_PARAMS_BYTES, params_blob), params_blob)
        projector = self._blob(by_type[PROJECTOR_MEDIA_TYPE], manifest)[1] if PROJECTOR_MEDIA_TYPE in by_type else None
        return OllamaModel(name, blob, blob.stat().st_size, digest, params, hashlib.sha256(raw).hexdigest(),
                           projector)

    def _blob(self, layer: dict, manifest: Path) -> tuple[str, Path]:
        match = _DIGEST_RE.match(str(layer.get("digest", "")))
        if match is None:
            raise ModelFileError(manifest, f"bad layer digest {str(layer.get('digest'))[:80]!r} "
                                           "(expected sha256:<64 hex digits>)")
        hexdigest = match.group(1)
        path = self.root / "blobs" / f"sha256-{hexdigest}"
        if not path.is_file():
            raise ModelFileError(manifest, f"its blob sha256-{hexdigest} is missing from {self.root / 'blobs'}")
        return hexdigest, self._inside(path)


def _read_json(path: Path, limit: int, shown: Path) -> dict:
    return _parse_json(_read_limited(path, limit, shown), shown)


def _read_limited(path: Path, limit: int, shown: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise ModelFileError(shown, f"cannot read: {exc.strerror}") from None
    if len(raw) > limit:
        raise ModelFileError(shown, f"larger than {limit} bytes; not an Ollama manifest or params layer")
    return raw


def _parse_json(raw: bytes, shown: Path) -> dict:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(shown, f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFileError(shown, "expected a JSON object")
    return data


def check_params(params: dict, path: Path) -> dict:
    """The params layer's options that llmd applies, type-checked; unknown keys (mirostat, ...) are left out."""
    out = {}
    for key, kinds in PARAM_TYPES.items():
        if key not in params:
            continue
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ModelFileError(path, f"params: {key} has the wrong type ({type(value).__name__})")
        if key == "stop" and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            raise ModelFileError(path, "params: stop must be a list of strings")
        out[key] = value
    return out
