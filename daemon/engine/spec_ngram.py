"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the current suffix.

No model is involved, so a proposal costs microseconds; it pays off when the output copies from the prompt (code
edits, summaries, retrieval answers). Longer n-grams are tried first because their continuations are more reliable.
"""

from __future__ import annotations

MAX_SEARCH_TOKENS = 8192  # only the most recent tokens are searched, so a step's cost stays bounded


def ngram_propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Up to k tokens continuing the latest earlier match of the last n tokens (n from max_n down to min_n)."""
    size = len(tokens)
    if k <= 0 or size < min_n + 1:
        return []
    lo = max(0, size - MAX_SEARCH_TOKENS)
    last = tokens[-1]
    # End positions (inclusive) of earlier occurrences of the last token, found with C-speed list.index.
    ends = []
    i = lo
    while True:
        try:
            j = tokens.index(last, i, size - 1)
        except ValueError:
            break
        ends.append(j)
        i = j + 1
    if not ends:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for end in reversed(ends):
            start = end - n + 1
            if start >= lo and tokens[start:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []
