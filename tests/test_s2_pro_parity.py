"""S2 Pro against the official code (goldens of fish-speech 3dd1f85 on the tiny checkpoints, seeds 0 and 1): the prompt
position by position (no reference, one, two, a long text) and the slow AR's token logits after its prefill. The
greedy frames, served by the engine, are `test_s2_pro_engine.py`'s."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_ray.engine.fixed_shape import prefill_forward
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint
from omni_ray.models.s2_pro.dual_ar_model import DualARModel, S2ProConfig, load_dual_ar
from omni_ray.models.s2_pro.prompt import Reference, build_prompt, load_encoder

GOLDENS = Path(__file__).parent / "goldens" / "s2_pro"
SEEDS = (0, 1)
CASES = ("plain", "one_reference", "two_references", "long_text")
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def golden(seed: int) -> dict[str, Any]:
    return json.loads((GOLDENS / f"dual_ar_seed{seed}.json").read_text())


@lru_cache(maxsize=None)
def checkpoint(seed: int, directory: str) -> Path:
    return write_tiny_checkpoint(Path(directory) / f"seed{seed}", seed)


@lru_cache(maxsize=None)
def model(seed: int, directory: str) -> DualARModel:
    path = checkpoint(seed, directory)
    return load_dual_ar(path, S2ProConfig.from_checkpoint(path), "cpu", torch.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("s2_pro_parity"))


def prefill_logits(dual_ar: DualARModel, prompt: torch.Tensor) -> torch.Tensor:
    """The slow AR's token logits at the last position of `prompt` [11, T] (token ids, then ten rows of codes)."""
    spec = dual_ar.config.slow
    cache = SlotKVCache(spec.num_layers, 1, prompt.shape[1], spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    hidden, _ = prefill_forward(dual_ar.slow, cache, dual_ar.input_embeddings(prompt[0], prompt[1:])[None],
                                torch.tensor([0]))
    return dual_ar.token_logits(hidden[0, -1])


def test_the_tiny_checkpoint_is_the_one_the_goldens_were_made_on(checkpoints: str) -> None:
    for seed in SEEDS:
        directory = checkpoint(seed, checkpoints)
        digests = {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in CHECKPOINT_FILES}
        assert digests == golden(seed)["checkpoint_sha256"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case_name", CASES)
def test_the_prompt_equals_the_official_one_position_by_position(checkpoints: str, seed: int, case_name: str) -> None:
    case = golden(seed)["cases"][case_name]
    directory = checkpoint(seed, checkpoints)
    config = S2ProConfig.from_checkpoint(directory)
    references = [Reference(torch.tensor(ref["codes"]), ref["text"]) for ref in case["references"]]
    prompt = build_prompt(case["text"], references, load_encoder(directory), config.semantic_begin, config.num_codebooks)
    assert prompt.tolist() == case["prompt"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case_name", CASES)
def test_the_prefill_logits_equal_the_official_code(checkpoints: str, seed: int, case_name: str) -> None:
    case = golden(seed)["cases"][case_name]
    with torch.inference_mode():
        logits = prefill_logits(model(seed, checkpoints), torch.tensor(case["prompt"], dtype=torch.long))
    torch.testing.assert_close(logits, torch.tensor(case["prefill_logits"]), rtol=1e-4, atol=1e-4)


def _official() -> tuple[Path, Path] | None:
    """The official code's venv python and source: ``$FISH_SPEECH_VENV`` (or /work/venv-fish-speech) and
    ``$FISH_SPEECH_SRC`` (or /work/fish-speech-src), when both exist (tests/goldens/s2_pro/make_venv.sh builds them)."""
    python = Path(os.environ.get("FISH_SPEECH_VENV", "/work/venv-fish-speech")) / "bin" / "python"
    source = Path(os.environ.get("FISH_SPEECH_SRC", "/work/fish-speech-src"))
    return (python, source) if python.is_file() and (source / "fish_speech").is_dir() else None


@pytest.mark.skipif(_official() is None, reason="opt-in fidelity check: the official fish-speech venv and source are "
                    "absent (tests/goldens/s2_pro/make_venv.sh builds them)")
def test_the_official_code_still_writes_the_committed_goldens(tmp_path: Path) -> None:
    official = _official()
    assert official is not None
    python, source = official
    out = tmp_path / "dual_ar_seed0.json"
    subprocess.run([str(python), str(GOLDENS / "make_goldens.py"), "--seed", "0", "--out", str(out),
                    "--project-python", sys.executable], check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(source)})
    assert json.loads(out.read_text()) == golden(0)
