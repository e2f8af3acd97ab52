"""Incremental detokenization gives, delta by delta and then its end-of-reply flush, exactly the text that decoding
the whole reply gives; the orchestrator streams the same text it finishes with."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
from transformers import AutoTokenizer

from omni_ray.config import PipelineConfig
from omni_ray.detokenizer import IncrementalDetokenizer
from omni_ray.events import Finished, TextDelta
from omni_ray.models.qwen3_omni.orchestrator import Orchestrator
from omni_ray.models.qwen3_omni.prompt import Prompt

TEXTS = ["Hello there, how are you?", "Ünïcödé — 你好，世界！ 🎉🎶 ok", "  spaced   out\n\nlines\t", "日本語のテキスト😀"]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def _cut_mid_character(tokenizer: Any) -> list[int]:
    """The longest prefix of an encoded reply whose full decode ends in an incomplete UTF-8 sequence."""
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for n in range(len(ids) - 1, 0, -1):
            if tokenizer.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd"):
                return ids[:n]
    raise AssertionError("no reply prefix ends mid-character: the tokenizer merges every multi-byte character")


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


def test_deltas_match_decoding_the_whole_reply(tokenizer: Any) -> None:
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences += [ids[:n] for ids in sequences for n in range(1, len(ids))]  # replies cut off anywhere
    rng = random.Random(0)
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(20)]  # arbitrary ids, specials too
    for ids in sequences:
        detokenizer = IncrementalDetokenizer(tokenizer)
        deltas = [detokenizer.push(i) for i in ids]
        assert deltas == _full_decode_deltas(tokenizer, ids)
        rest = detokenizer.flush()
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) + rest == detokenizer.text == whole
        assert detokenizer.flush() == "" and detokenizer.pending == []


def test_a_reply_cut_off_mid_character_is_flushed_at_its_end(tokenizer: Any) -> None:
    ids = _cut_mid_character(tokenizer)
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.push(i) for i in ids)
    assert not streamed.endswith("\ufffd")  # held back while more bytes may come
    assert detokenizer.pending  # the tokens of the incomplete character
    rest = detokenizer.flush()
    assert rest.endswith("\ufffd")
    assert streamed + rest == tokenizer.decode(ids, skip_special_tokens=True)


class _ThinkerStream:
    """A stage client whose Thinker replies with fixed tokens (no audio, so no other stage is opened)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    async def stream(self, method: str, *args: Any) -> AsyncIterator[dict[str, Any]]:
        assert method == "generate"
        yield {"type": "ready", "peer": None}
        for t in self.tokens:
            yield {"type": "token", "token": t, "t": 0.0}
        yield {"type": "final", "finish_reason": "length"}

    async def call(self, method: str, *args: Any) -> Any:
        raise AssertionError(f"unexpected call {method}")


def test_the_orchestrator_streams_the_text_it_finishes_with(tokenizer: Any) -> None:
    ids = _cut_mid_character(tokenizer)
    prompts = SimpleNamespace(tokenizer=tokenizer, build=lambda messages: Prompt([1, 2, 3], [], 0))
    model_config = SimpleNamespace(im_end_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                   talker_config=SimpleNamespace(speaker_id={"ethan": 0}))
    orchestrator = Orchestrator({"thinker": _ThinkerStream(ids)}, prompts, PipelineConfig(),  # type: ignore[arg-type]
                                model_config)

    async def reply() -> list[Any]:
        return [e async for e in orchestrator.generate([{"role": "user", "content": "hi"}], max_tokens=len(ids),
                                                       audio=False)]

    events = asyncio.run(reply())
    deltas = [e for e in events if isinstance(e, TextDelta)]
    final = events[-1]
    assert isinstance(final, Finished) and final.token_ids == ids
    assert "".join(d.text for d in deltas) == final.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert final.text.endswith("\ufffd")
    assert [t for d in deltas for t in d.token_ids] == ids  # every token reaches the client with its text
