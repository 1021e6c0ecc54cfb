"""Short Ollama-style names for popular Hugging Face repos, and which small model drafts for which big one."""

from __future__ import annotations

ALIASES: dict[str, str] = {
    "smollm2:135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2:360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2:1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "qwen2.5:0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5:1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5:3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5:7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5-coder:1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "qwen2.5-coder:7b": "Qwen/Qwen2.5-Coder-7B-Instruct",
    "qwen3:0.6b": "Qwen/Qwen3-0.6B",
    "qwen3:1.7b": "Qwen/Qwen3-1.7B",
    "qwen3:4b": "Qwen/Qwen3-4B",
    "qwen3:8b": "Qwen/Qwen3-8B",
    "llama3.2:1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2:3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama3.1:8b": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral:7b": "mistralai/Mistral-7B-Instruct-v0.3",
}

# target -> draft for speculative decoding; each pair shares a tokenizer.
DRAFT_PAIRS: dict[str, str] = {
    "qwen2.5:7b": "qwen2.5:0.5b",
    "llama3.1:8b": "llama3.2:1b",
    "smollm2:1.7b": "smollm2:135m",
}


def alias_for_repo(repo_id: str) -> str | None:
    """The alias naming this repo, if any (case-insensitive, as the Hub treats repo ids)."""
    wanted = repo_id.lower()
    for alias, repo in ALIASES.items():
        if repo.lower() == wanted:
            return alias
    return None


def draft_for(name: str) -> str | None:
    """The known draft model for a target given as an alias or a repo id, else None."""
    alias = name.lower() if name.lower() in ALIASES else alias_for_repo(name)
    return DRAFT_PAIRS.get(alias) if alias else None


def family_suggestions(name: str) -> list[str]:
    """Aliases of the same family, for names given without a size (`qwen2.5` -> `qwen2.5:0.5b`, ...)."""
    family = name.lower().split(":")[0]
    return [a for a in ALIASES if a.split(":")[0] == family]
