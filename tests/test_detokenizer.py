"""Incremental detokenization gives, delta by delta, exactly the text that decoding the whole reply gives."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoTokenizer

from omni_ray.detokenizer import IncrementalDetokenizer


def _full_decode_deltas(tokenizer: object, ids: list[int]) -> list[str]:
    """The reference: decode everything after each token, emit what grew (held back on a partial character)."""
    emitted, deltas = "", []
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)  # type: ignore[attr-defined]
        if len(text) > len(emitted) and not text.endswith("\ufffd"):
            deltas.append(text[len(emitted):])
            emitted = text
        else:
            deltas.append("")
    return deltas


def test_deltas_match_decoding_the_whole_reply(tiny_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    texts = ["Hello there, how are you?", "Ünïcödé — 你好，世界！ 🎉🎶 ok", "  spaced   out\n\nlines\t", "日本語のテキスト😀"]
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    rng = random.Random(0)
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(20)]  # arbitrary ids, specials too
    for ids in sequences:
        detokenizer = IncrementalDetokenizer(tokenizer)
        deltas = [detokenizer.push(i) for i in ids]
        assert deltas == _full_decode_deltas(tokenizer, ids)
