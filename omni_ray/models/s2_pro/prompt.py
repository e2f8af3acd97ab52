"""S2 Pro's prompt, laid out as the official inference lays it out: a system turn (with reference speakers' text and
codes, or without), the text to speak as the user turn, and the assistant turn opened for voice; as [1 + codebooks, T]
rows of token ids and, at semantic positions, their codes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

IM_START, IM_END, VOICE = "<|im_start|>", "<|im_end|>", "<|voice|>"
SYSTEM_PLAIN = "convert the provided text to speech"
SYSTEM_WITH_REFERENCES = "convert the provided text to speech reference to the following:\n\nText:\n"
SPEECH_FOLLOWS = "\n\nSpeech:\n"
SPEAKER_TAG = re.compile(r"<\|speaker:\d+\|>")


def semantic_token(code: int) -> str:
    return f"<|semantic:{code}|>"


@dataclass
class Reference:
    """A reference speaker: its speech's codes [codebooks, T] (row 0 the semantic codebook) and their transcript."""

    codes: torch.Tensor
    text: str


def reference_text(references: Sequence[Reference]) -> str:
    """The references' transcripts, one a line, each tagged with its speaker (`<|speaker:i|>`) unless it has a tag."""
    return "\n".join(ref.text if SPEAKER_TAG.search(ref.text) else f"<|speaker:{i}|>{ref.text}"
                     for i, ref in enumerate(references))


def build_prompt(text: str, references: Sequence[Reference], encode: Callable[[str], list[int]],
                 semantic_begin: int, num_codebooks: int) -> torch.Tensor:
    """The prompt rows [1 + num_codebooks, T]: row 0 token ids, rows 1.. the codes at the references' semantic
    positions (zeros elsewhere). Each text piece is tokenized on its own (`encode`: without added BOS/EOS), as the
    official encoder does, so token boundaries fall where its do."""
    pieces: list[str | torch.Tensor] = [f"{IM_START}system\n"]
    if references:
        codes = torch.cat([ref.codes.to(torch.long) for ref in references], dim=1)
        if codes.shape[0] != num_codebooks:
            raise ValueError(f"reference codes have {codes.shape[0]} codebooks, the model {num_codebooks}")
        pieces += [SYSTEM_WITH_REFERENCES, reference_text(references), SPEECH_FOLLOWS, codes]
    else:
        pieces.append(SYSTEM_PLAIN)
    pieces += [f"{IM_END}\n", f"{IM_START}user\n", text, f"{IM_END}\n", f"{IM_START}assistant\n{VOICE}"]
    columns = []
    for piece in pieces:
        if isinstance(piece, torch.Tensor):
            column = torch.cat([piece[:1] + semantic_begin, piece])
        else:
            ids = torch.tensor(encode(piece), dtype=torch.long)
            column = torch.cat([ids[None], torch.zeros(num_codebooks, ids.shape[0], dtype=torch.long)])
        columns.append(column)
    return torch.cat(columns, dim=1)


def load_encoder(checkpoint: Path) -> Callable[[str], list[int]]:
    """The checkpoint's `tokenizer.json` as `build_prompt`'s `encode`: special tokens in the text become their ids,
    and nothing is added around it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids
