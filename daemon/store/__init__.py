"""The model store: model names -> files (local folder, .gguf, HF hub cache, Ollama's store, bundled default, names
made with /api/create and /api/copy); pull, list, show, rm; digests. `resolve` takes names from the command line and
config (paths allowed); `resolve_name` takes names from requests (never a path)."""

from .aliases import ALIASES, DRAFT_PAIRS, draft_for
from .bundled import BUNDLED_NAME, bundled_model_path
from .created import Created, find_created
from .digest import model_digest
from .files import ModelFiles
from .hub import hub_cache_dir
from .info import ModelInfo, describe, human_count, human_size
from .manage import ListedModel, list_models, remove_model
from .names import BadModelName, check_name, resolve_name, resolve_store_name
from .ollama import OllamaStore
from .pull import pull
from .resolve import resolve

__all__ = [
    "ALIASES", "BUNDLED_NAME", "BadModelName", "Created", "OllamaStore", "check_name", "resolve_name", "DRAFT_PAIRS",
    "ListedModel", "ModelFiles", "ModelInfo", "bundled_model_path", "describe", "draft_for", "find_created",
    "human_count", "human_size", "hub_cache_dir", "list_models", "model_digest", "pull", "remove_model", "resolve",
    "resolve_store_name",
]
