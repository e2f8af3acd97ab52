"""The bandwidth floor of a decode step at a batch size: weight bytes read (experts any row picks) over bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.floors import (
    BYTES_PER_PARAM, H200_BANDWIDTH, distinct_experts, floor_ms, frame_seconds, rtf_floor, step_bytes,
)
from omni_ray.models.qwen3_omni.talker_model import TalkerModel

FULL = Path(__file__).resolve().parent.parent / "omni_ray" / "assets" / "qwen3_omni_30b_a3b_config.json"


@pytest.fixture(scope="module")
def config() -> Qwen3OmniMoeConfig:
    return Qwen3OmniMoeConfig.from_json_file(str(FULL))


def test_distinct_experts_runs_from_one_rows_picks_to_all_experts() -> None:
    assert distinct_experts(128, 8, 1) == pytest.approx(8)
    assert distinct_experts(128, 8, 32) == pytest.approx(111.8, abs=0.1)
    assert distinct_experts(128, 8, 10_000) == pytest.approx(128)
    counts = [distinct_experts(128, 6, b) for b in (1, 2, 8, 32, 64)]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)


def test_thinker_floor_at_batch_1_is_the_models_step_bytes_less_the_embedding_table(config: Qwen3OmniMoeConfig) -> None:
    """A batch-1 Thinker step of the 30B model reads about 6.7 GB counting the token embedding table (0.62 GB), of
    which a step reads only a row: the floor leaves the table out."""
    text = config.thinker_config.text_config
    table = 2 * text.vocab_size * text.hidden_size
    assert step_bytes(config, "thinker", 1) + table == pytest.approx(6.7e9, rel=0.01)
    assert floor_ms(config, "thinker", 1) == pytest.approx(1000 * step_bytes(config, "thinker", 1) / H200_BANDWIDTH)


def test_a_batch_of_different_tokens_reads_most_experts(config: Qwen3OmniMoeConfig) -> None:
    # 48 layers x 111.8 of 128 experts x 3 x 2048 x 768 parameters, in bf16, plus the rest: about 53 GB, 12.3 ms
    assert step_bytes(config, "thinker", 32) == pytest.approx(53.1e9, rel=0.01)
    assert floor_ms(config, "thinker", 32) == pytest.approx(12.35, abs=0.05)
    assert floor_ms(config, "thinker", 1) < floor_ms(config, "thinker", 8) < floor_ms(config, "thinker", 32)


def test_talker_floor_counts_the_code_predictor_once_per_completed_group(config: Qwen3OmniMoeConfig) -> None:
    with torch.device("meta"):
        predictor = TalkerModel(config.talker_config).code_predictor
    layers = sum(p.numel() for n, p in predictor.model.named_parameters() if "codec_embedding" not in n)
    groups = int(config.talker_config.num_code_groups)
    # the frame's 15 passes through the predictor's 5 layers are most of a batch-1 step
    assert step_bytes(config, "talker", 1) > BYTES_PER_PARAM * layers * (groups - 1)
    assert floor_ms(config, "talker", 1) == pytest.approx(0.70, abs=0.02)
    assert floor_ms(config, "talker", 32) == pytest.approx(1.74, abs=0.03)


def test_rtf_floor_paces_the_talkers_first_frames_by_the_thinker(config: Qwen3OmniMoeConfig) -> None:
    assert frame_seconds(config) == pytest.approx(0.08)  # 12.5 frames per second of audio
    thinker, talker = floor_ms(config, "thinker", 32), floor_ms(config, "talker", 32)
    expected = (128 * thinker + 272 * talker) / 1000 / (400 * 0.08)
    assert rtf_floor(config, 32, 128, 400) == pytest.approx(expected)
    assert rtf_floor(config, 32, 128, 400) > 0.05  # independently routed rows: above the RTF target of 0.05 at 32 streams
    # random weights route 32 distinct prompts' rows to 51 of the Thinker's 128 experts (`benchmarks/expert_reads.py`)
    measured = {"thinker": 51.2 / 128, "talker": 97.4 / 128}
    thinker_read, talker_read = (floor_ms(config, stage, 32, expert_share=measured[stage]) for stage in measured)
    expected_read = (128 * thinker_read + 272 * talker_read) / 1000 / (400 * 0.08)
    assert rtf_floor(config, 32, 128, 400, expert_shares=measured) == pytest.approx(expected_read)
    assert rtf_floor(config, 32, 128, 400, expert_shares=measured) == pytest.approx(0.038, abs=1e-3)  # below 0.05
    # a reply with no more text than frames' worth waits on the Thinker for every frame
    assert rtf_floor(config, 32, 400, 400) == pytest.approx(thinker / 1000 / 0.08)
