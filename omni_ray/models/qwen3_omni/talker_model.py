"""Qwen3-Omni Talker's modules (MoE codec backbone, MTP code predictor, Thinker→Talker projections) and their loading."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_ray.layers.basic import ResizeMLP
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.models.qwen3_omni.talker_inputs import talker_prefix_positions
from omni_ray.weights import fuse_expert_weights, load_module, random_module, read_rows, read_tensors


class CodePredictor(nn.Module):
    """Dense decoder that completes code groups 1..G-1 of a frame from [talker hidden, group-0 embedding]."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.model = DecoderStack(DecoderSpec.from_hf(cfg))
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(cfg.num_code_groups - 1)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )


class TalkerModel(nn.Module):
    """Codec embedding + MoE decoder + codec head, the Thinker→Talker projections and the code predictor."""

    def __init__(self, talker_config: Any) -> None:
        super().__init__()
        text = talker_config.text_config
        self.model = DecoderStack(DecoderSpec.from_hf(text, always_moe=True))
        self.model.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.text_projection = ResizeMLP(talker_config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(talker_config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.code_predictor = CodePredictor(talker_config.code_predictor_config)

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G] → sum of every group's embedding [B, h] (the next step's codec input)."""
        total = self.model.codec_embedding(codes[:, 0])
        for g, table in enumerate(self.code_predictor.model.codec_embedding):
            total = total + table(codes[:, g + 1])
        return total


@dataclass
class TalkerAssets:
    """The Talker model plus the three Thinker embedding rows it needs (tts_bos, tts_eos, tts_pad), and for early
    prefill the Thinker's whole token embedding table, in host memory."""

    model: TalkerModel
    tts_bos: torch.Tensor
    tts_eos: torch.Tensor
    tts_pad: torch.Tensor
    thinker_embeddings: torch.Tensor | None = None  # [vocab, thinker hidden] on the CPU

    def prompt_prefix(self, prompt_ids: list[int], config: Any) -> dict[str, torch.Tensor]:
        """What the Thinker relays for a text-only prompt (its layer-0 states at the user turn's positions and the
        assistant prefix), made here from the token ids."""
        assert self.thinker_embeddings is not None
        positions, assistant_start = talker_prefix_positions(prompt_ids, config)
        embeds = self.thinker_embeddings[torch.tensor(prompt_ids)]
        return {"user_states": embeds[positions], "user_multimodal": torch.zeros(len(positions), dtype=torch.bool),
                "assistant_prefix": embeds[assistant_start : assistant_start + 3]}


def load_talker(
    checkpoint: Path | None, config: Any, device: str, dtype: torch.dtype, thinker_embeddings: bool = False
) -> TalkerAssets:
    """Reads `talker.*` plus three rows of the Thinker's token embedding (all of them, into host memory, with
    `thinker_embeddings`); random weights when no checkpoint."""
    if checkpoint is None:
        model: TalkerModel = random_module(lambda: TalkerModel(config.talker_config), device, dtype)  # type: ignore[assignment]
        rows = torch.randn(3, config.talker_config.thinker_hidden_size, device=device, dtype=dtype) * 0.02
    else:
        model = TalkerModel(config.talker_config)
        load_module(model, fuse_expert_weights(read_tensors(checkpoint, "talker.")))
        model = model.to(device=device, dtype=dtype).eval()
        rows = read_rows(
            checkpoint,
            "thinker.model.embed_tokens.weight",
            [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
        ).to(device=device, dtype=dtype)
    with torch.inference_mode():
        bos, eos, pad = model.text_projection(rows)
    table = None
    if thinker_embeddings:
        if checkpoint is None:
            vocab = config.thinker_config.text_config.vocab_size
            table = torch.randn(vocab, config.talker_config.thinker_hidden_size, dtype=dtype) * 0.02
        else:
            table = read_tensors(checkpoint, "thinker.model.embed_tokens.")["weight"].to(dtype)
    return TalkerAssets(model, bos, eos, pad, table)
