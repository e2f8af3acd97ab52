"""S2 Pro's full-size random checkpoint: the tokenizer's published ids, the published layout's shapes as the Dual-AR
loads them, the shards, a small config written end to end, and the floors' bytes."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from omni_ray.config import ModelSource
from omni_ray.floors import H100_BANDWIDTH, s2_pro_step_floor_ms
from omni_ray.models.s2_pro.checkpoint import TINY_CODEBOOK_SIZE, tiny_config, weight_layout
from omni_ray.models.s2_pro.codec import TINY_CODEC_CONFIG, load_codec
from omni_ray.models.s2_pro.dual_ar_model import PUBLISHED_CONFIG, DualARModel, S2ProConfig, dual_ar_tensors
from omni_ray.models.s2_pro.prompt import load_encoder
from omni_ray.models.s2_pro.random_checkpoint import (
    INDEX_FILE, weight_shards, write_published_tokenizer, write_random_checkpoint,
)

PUBLISHED = json.loads(PUBLISHED_CONFIG.read_text())


def test_the_tokenizer_has_the_published_ids_and_vocabulary(tmp_path: Path) -> None:
    write_published_tokenizer(tmp_path, PUBLISHED)
    encode = load_encoder(tmp_path)
    for token, token_id in (("<|im_end|>", 151645), ("<|pad|>", 151669), ("<|audio_pad|>", 151677),
                            ("<|semantic:0|>", 151678), ("<|semantic:4095|>", 155773)):
        assert encode(token) == [token_id]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == PUBLISHED["text_config"]["vocab_size"] == 155776
    ids = encode("<|im_start|>user\nThe quiet harbour woke slowly.<|im_end|>\n")
    assert ids[0] == 151644 and 151645 in ids and max(i for i in ids if i < 151643) < 1000  # text: the tiny BPE's


def test_the_published_layout_is_what_the_dual_ar_loads() -> None:
    config = S2ProConfig.from_dict(PUBLISHED)
    shapes = weight_layout(PUBLISHED)
    meta = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
    slow = {k.removeprefix("text_model.model."): v for k, v in meta.items() if k.startswith("text_model.model.")}
    audio = {k.removeprefix("audio_decoder."): v for k, v in meta.items() if k.startswith("audio_decoder.")}
    with torch.device("meta"):
        model = DualARModel(config)
    mapped = {key: tuple(value.shape) for key, value in dual_ar_tensors(slow, audio, config).items()}
    assert mapped == {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert 4.5e9 < sum(math.prod(shape) for shape in shapes.values()) < 4.6e9
    shards = weight_shards(shapes)
    assert [key for shard in shards for key in shard] == list(shapes) and len(shards) == 5


def test_a_small_config_is_written_sharded_in_bfloat16_and_loads(tmp_path: Path) -> None:
    config_file = tmp_path / "config.json"
    small = {**tiny_config(151678, 155776, 4096), "eos_token_id": 151645}
    small["semantic_end_token_id"] = 151678 + 4096 - 1
    config_file.write_text(json.dumps(small))
    codec = replace(TINY_CODEC_CONFIG, codebook_size=TINY_CODEBOOK_SIZE, semantic_codebook_size=4096)
    out = write_random_checkpoint(tmp_path / "ckpt", device="cpu", config_file=config_file, codec=codec)
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert set(weight_map) == set(weight_layout(small))
    for name in set(weight_map.values()):
        with safe_open(str(out / name), framework="pt") as f:
            assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
    assert S2ProConfig.from_checkpoint(out).vocab_size == 155776
    assert load_codec(out, config=codec).num_quantizers == 10


def test_random_weights_resolve_to_the_cached_full_size_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from omni_ray.models.s2_pro import model_files

    made: list[tuple[int, Path]] = []

    def fake_ensure(seed: int, config_file: Path) -> Path:
        made.append((seed, config_file))
        (tmp_path / "config.json").write_text(PUBLISHED_CONFIG.read_text())
        return tmp_path

    monkeypatch.setattr(model_files, "ensure_random_checkpoint", fake_ensure)
    files = model_files.resolve_model(ModelSource(family="s2_pro", random_weights=True))
    assert made == [(0, PUBLISHED_CONFIG)] and files.config.slow.num_layers == 36


def test_the_floors_read_the_slow_ar_once_and_the_fast_ar_once_a_codebook() -> None:
    # the figures on one H100: about 2.4 ms for the slow AR with its tied head, 2.5 ms for 10 fast passes
    assert s2_pro_step_floor_ms(PUBLISHED, 1, 0, H100_BANDWIDTH) == pytest.approx(4.9, abs=0.05)
    assert s2_pro_step_floor_ms(PUBLISHED, 32, 200, H100_BANDWIDTH) > s2_pro_step_floor_ms(PUBLISHED, 1, 200,
                                                                                           H100_BANDWIDTH)


@pytest.mark.parametrize("name", ["serve_s2_pro_random_1gpu.yaml", "serve_s2_pro_tiny_cpu.yaml"])
def test_the_benchmark_layouts_are_s2_pro_pipelines(name: str) -> None:
    import yaml

    from benchmarks.tts_e2e.run import layout_family
    from omni_ray.config import PipelineConfig

    layout = Path(__file__).resolve().parent.parent / "benchmarks" / name
    pipeline = PipelineConfig.model_validate(yaml.safe_load(layout.read_text())["applications"][0]["args"]["pipeline"])
    assert layout_family(layout) == "s2_pro" and pipeline.model.random_weights == ("random" in name)
    assert not pipeline.stages.vocoder.streaming.stateful and pipeline.stages.talker.engine.max_batch >= (
        32 if "random" in name else 2)
