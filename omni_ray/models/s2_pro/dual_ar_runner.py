"""S2 Pro's Dual-AR on the shared codec Talker: the slow AR's batched steps, the fast AR as each frame's codebook pass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from omni_ray.engine.codec_sequence import TalkerSequence, TalkerStepOutput
from omni_ray.engine.codec_talker import CodecTalkerRunner, CodecTalkerSpec
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import FilterOrder, RepetitionAwareSampling, SamplingParams
from omni_ray.models.s2_pro.dual_ar_model import DualARModel, S2ProConfig, load_dual_ar
from omni_ray.models.s2_pro.prompt import IM_END, Reference, build_prompt, load_encoder

# The official API's sampling (its CLI's is temperature 1.0, top_p 0.9); top_k is always 30 there.
DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_p=0.8, top_k=30)
DEFAULT_MAX_NEW_TOKENS = 1024


@dataclass
class DualARAssets:
    """What the runner drives: the Dual-AR model (the shared runner's `assets.model`)."""

    model: DualARModel


@dataclass
class DualARSequence(TalkerSequence):
    """A Dual-AR request: its whole prompt [1 + num_codebooks, T] (token ids, then the codes at semantic positions)."""

    prompt: torch.Tensor | None = None


def dual_ar_sequence(
    request_id: str, prompt: torch.Tensor, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: SamplingParams = DEFAULT_SAMPLING, ignore_eos: bool = False,
) -> DualARSequence:
    """The sequence of a built prompt (`prompt.build_prompt`): at most `max_new_tokens` frames (a reply the cap ends
    finishes with `length`, one that draws `<|im_end|>` with `stop`), its codebooks drawn with its token's
    temperature, top_p and top_k. The official code takes a repetition penalty and never applies it: neither does
    this."""
    unpenalized = sampling.model_copy(update={"repetition_penalty": 1.0})
    return DualARSequence(request_id, unpenalized, -1, max(int(max_new_tokens), 1), ignore_eos=ignore_eos,
                          code_sampling=unpenalized, thinker_done=True, prompt=prompt)


def dual_ar_spec(config: S2ProConfig, eos: int) -> CodecTalkerSpec:
    """The shared runner's view of a Dual-AR: group 0 is the slow AR's token (the semantic ids or `<|im_end|>`), the
    fast AR completes codebooks 1..n-1 (codebook 0 is the token's semantic code)."""
    fast = config.fast
    return CodecTalkerSpec(
        num_groups=config.num_codebooks, vocab=config.vocab_size, eos=eos, bos=eos, predictor_layers=fast.num_layers,
        predictor_kv_heads=fast.num_kv_heads, predictor_head_dim=fast.head_dim, predictor_vocab=config.codebook_size,
        code_sampling=DEFAULT_SAMPLING, sampled_ids=(config.semantic_begin, config.semantic_end),
    )


def frame_codes(output: TalkerStepOutput) -> list[int] | None:
    """A step output's codec frame (codebooks 0..n-1), without the token that leads it."""
    return None if output.codes is None else output.codes[1:]


class DualARRunner(CodecTalkerRunner):
    """S2 Pro's steps on the shared codec Talker. The slow AR is the backbone: tied-embedding logits masked to the
    semantic ids and `<|im_end|>`, drawn in fish-speech's order with repetition-aware sampling. The fast AR is the
    code predictor: position 0 the slow AR's normed hidden state (projected where the widths differ), position 1
    codebook 0's embedding (the token's semantic code), then each drawn code's, all from one table, logits by one
    head. A frame is [token, code 0..n-1]; the next slow step reads its fused embedding. The whole text is in the
    prompt: no text is streamed."""

    first_text_in_prompt = False
    streams_text = False
    filter_order = FilterOrder.RAW_LOGITS

    def __init__(self, model: DualARModel, eos: int, cache: SlotKVCache, max_batch: int,
                 encode: Callable[[str], list[int]] | None = None, **options: Any) -> None:
        config = model.config
        self.repetition_aware = RepetitionAwareSampling(config.semantic_begin, config.semantic_end)
        self.config = config
        self.encode = encode
        super().__init__(DualARAssets(model), dual_ar_spec(config, eos), cache, max_batch, **options)

    def prompt(self, text: str, references: Sequence[Reference] = ()) -> torch.Tensor:
        """The official prompt for `text` in the voice of `references` (needs the tokenizer: `load` gives it)."""
        assert self.encode is not None, "a runner without its tokenizer takes built prompts only"
        return build_prompt(text, references, self.encode, self.config.semantic_begin, self.config.num_codebooks)

    @property
    def backbone(self) -> Any:
        return self.model.slow

    @property
    def predictor(self) -> Any:
        return self.model.fast

    def _bos_embedding(self, bos: int) -> torch.Tensor:
        # every prompt is whole at admission, so no early prefill reads it
        return torch.zeros_like(self.model.embeddings.weight[0])

    def _prompt_length(self, seq: TalkerSequence) -> int:
        assert isinstance(seq, DualARSequence) and seq.prompt is not None
        return int(seq.prompt.shape[1])

    def _prompts(self, seqs: list[TalkerSequence], early: bool = False) -> list[torch.Tensor]:
        assert not early
        prompts = []
        for seq in seqs:
            assert isinstance(seq, DualARSequence) and seq.prompt is not None
            rows = seq.prompt.to(self.device)
            prompts.append(self.model.input_embeddings(rows[0], rows[1:]))
        return prompts

    def _group0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.token_logits(hidden)

    def _predictor_start(
        self, hidden: torch.Tensor, group0: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        config = self.config
        code0 = (group0 - config.semantic_begin).clamp(0, config.codebook_size - 1)
        embeds = torch.stack([self.model.fast_input(hidden), self.model.fast_embeddings(code0)], dim=1)
        return embeds, [group0, code0], None

    def _predictor_weights(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.fast_output.weight, self.model.fast_embeddings.weight

    def _frame_feedback(self, codes: torch.Tensor, summed: torch.Tensor | None) -> torch.Tensor:
        return self.model.input_embeddings(codes[:, :1], codes[:, 1:, None])[:, 0]


def load(checkpoint: Path, max_batch: int, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
         max_len: int | None = None, **options: Any) -> DualARRunner:
    """The runner of an official-layout checkpoint directory (config, weights, tokenizer): `max_batch` slots of
    `max_len` positions (the config's `max_seq_len` by default); `options` as `CodecTalkerRunner` takes them
    (`codec_talker.talker_options`)."""
    from tokenizers import Tokenizer

    checkpoint = Path(checkpoint)
    config = S2ProConfig.from_checkpoint(checkpoint)
    model = load_dual_ar(checkpoint, config, device, dtype)
    eos = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id(IM_END)
    if eos is None:
        raise ValueError(f"{checkpoint / 'tokenizer.json'} has no {IM_END} token")
    slow = config.slow
    cache = SlotKVCache(slow.num_layers, max_batch, max_len or config.max_seq_len, slow.num_kv_heads, slow.head_dim,
                        dtype, device)
    return DualARRunner(model, int(eos), cache, max_batch, encode=load_encoder(checkpoint), **options)
