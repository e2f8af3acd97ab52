"""Incremental detokenization: the text delta of each new token, decoding a short window instead of the whole reply."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Feeds token ids one at a time and returns the newly final text, if any.

    Decoding the whole reply for every token costs O(n) per token (O(n²) per reply). Here each step decodes only the
    ids since `prefix` (a few tokens): the window's text minus the text already emitted from it. A delta is held back
    while it ends in an incomplete UTF-8 sequence (U+FFFD), exactly as a full decode would show it. Concatenated
    deltas equal `tokenizer.decode(ids, skip_special_tokens=True)` for byte-level BPE tokenizers (Qwen's).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]
