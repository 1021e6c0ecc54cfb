"""Stop strings matched on the detokenized text across token boundaries.

Text is released only when it can no longer be the start of a stop string: the longest suffix of the unreleased
text that is a proper prefix of some stop string is held back. When a stop string appears, the text before it is
released and the stop string itself never is.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.held = ""
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add newly decoded text. Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stop:
            return delta, False
        text = self.held + delta
        first = -1
        for s in self.stop:
            i = text.find(s)
            if i != -1 and (first == -1 or i < first):
                first, self.matched = i, s
        if first != -1:
            self.held = ""
            return text[:first], True
        keep = self._partial_suffix_len(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release held text at the end of a request that did not stop on a stop string."""
        out, self.held = self.held, ""
        return out

    def _partial_suffix_len(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
