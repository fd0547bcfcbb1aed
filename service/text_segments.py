"""Splitting text into the segments spoken as separate engine requests: at sentence ends,
and long sentences at clause or word boundaries, so no segment approaches the model's 81.6 s
length cap. Incremental text (append, then flush) releases each sentence as soon as it is
complete. Standard library only."""

from __future__ import annotations

import re

# A sentence ends at . ! ? (and CJK/ellipsis forms) followed by whitespace, or at a newline.
_SENTENCE_END = re.compile(r"(?<=[.!?\u3002\uff01\uff1f\u2026])[\"')\]\u201d]*\s+|\n+")
_CLAUSE_END = re.compile(r"(?<=[,;:\u3001\uff0c])\s+")


class SegmentBuffer:
    def __init__(self, max_chars: int = 300):
        self.max_chars = max_chars
        self._pending = ""

    def append(self, text: str) -> list[str]:
        """Adds text; returns the sentences it completed."""
        self._pending += text
        pieces = _SENTENCE_END.split(self._pending)
        self._pending = pieces.pop()  # not yet terminated
        return [s for p in pieces for s in split_long(p.strip(), self.max_chars) if s]

    def flush(self) -> list[str]:
        rest, self._pending = self._pending.strip(), ""
        return split_long(rest, self.max_chars) if rest else []

    @property
    def pending(self) -> str:
        return self._pending


def split_text(text: str, max_chars: int = 300) -> list[str]:
    """A whole text -> segments: sentences packed together up to `max_chars`."""
    buf = SegmentBuffer(max_chars)
    sentences = buf.append(text) + buf.flush()
    segments: list[str] = []
    for s in sentences:
        if segments and len(segments[-1]) + 1 + len(s) <= max_chars:
            segments[-1] += " " + s
        else:
            segments.append(s)
    return segments


def split_long(sentence: str, max_chars: int) -> list[str]:
    if len(sentence) <= max_chars:
        return [sentence] if sentence else []
    parts: list[str] = []
    for clause in _CLAUSE_END.split(sentence):
        while len(clause) > max_chars:
            cut = clause.rfind(" ", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            parts.append(clause[:cut].strip())
            clause = clause[cut:].strip()
        if parts and len(parts[-1]) + 1 + len(clause) <= max_chars:
            parts[-1] += " " + clause
        elif clause:
            parts.append(clause)
    return [p for p in parts if p]
