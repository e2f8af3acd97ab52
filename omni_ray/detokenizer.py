"""Incremental detokenization: the text delta of each new token, decoding a short window instead of the whole reply."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Feeds token ids one at a time and returns the newly final text, if any.

    Decoding the whole reply for every token costs O(n) per token (O(n²) per reply). Here each step decodes only the
    ids since `prefix` (a few tokens): the window's text minus the text already emitted from it. A delta is held back
    while it ends in an incomplete UTF-8 sequence (U+FFFD), exactly as a full decode would show it; `flush` at the end
    of the reply hands over whatever is still held (a reply cut off mid-character ends in U+FFFD, as a full decode
    does). Concatenated deltas plus the flush equal `tokenizer.decode(ids, skip_special_tokens=True)` for byte-level
    BPE tokenizers (Qwen's); `text` is that concatenation so far.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids before this are already emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _emit(self, text: str, done: str) -> str:
        self.prefix, self.read = self.read, len(self.ids)
        delta = text[len(done) :]
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        """Add one token; the text it completes ("" while held back)."""
        self.ids.append(token_id)
        done = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        return self._emit(text, done)

    @property
    def pending(self) -> list[int]:
        """Ids pushed since the last emitted delta (their text is held back or empty)."""
        return self.ids[self.read :]

    def flush(self) -> str:
        """At the end of the reply: the text still held back, incomplete characters shown as U+FFFD ("" if none)."""
        if self.read == len(self.ids):
            return ""
        done = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(done):
            self.read = len(self.ids)  # tokens with no text (special ones): nothing to hand over
            return ""
        return self._emit(text, done)
