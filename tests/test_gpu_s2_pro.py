"""GPU: S2 Pro's Dual-AR on the codec Talker replayed from CUDA graphs (and with compiled layers) gives the official
code's greedy frames (the goldens), and seeded sampled requests stepped together give the same frames graphed as
eager; the stateful codec streams what the one-shot decode gives. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_ray.engine.loop import run_to_end
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint
from omni_ray.models.s2_pro.codec import load_codec
from omni_ray.models.s2_pro.codec_state import StatefulS2ProCodec
from omni_ray.models.s2_pro.dual_ar_runner import DEFAULT_SAMPLING, DualARRunner, dual_ar_sequence, load
from omni_ray.vocoder.schedule import ChunkSchedule
from omni_ray.vocoder.streaming import StatefulStreamingDecoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GOLDENS = Path(__file__).parent / "goldens" / "s2_pro" / "dual_ar_seed0.json"
CASES = ("plain", "one_reference", "two_references", "long_text")
TOP_K_1 = SamplingParams(temperature=1.0, top_k=1, top_p=1.0)  # the goldens' greedy draw


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("s2_pro_gpu"), seed=0)


def _runner(checkpoint: Path, graphs: bool, compiled: bool) -> DualARRunner:
    runner = load(checkpoint, 4, device="cuda", dtype=torch.float32, max_len=512, cuda_graphs=graphs,
                  compile_layers=compiled)
    runner.warmup(4)
    return runner


def _frames(outputs: list[Any]) -> list[list[int]]:
    return [out.codes for out in outputs if out.codes is not None]


@pytest.mark.parametrize("graphs,compiled", [(False, False), (True, False), (True, True)])
def test_four_greedy_requests_on_the_gpu_equal_the_official_code(checkpoint: Path, graphs: bool,
                                                                 compiled: bool) -> None:
    golden = json.loads(GOLDENS.read_text())
    runner = _runner(checkpoint, graphs, compiled)
    seqs = []
    for case in CASES:
        prompt = torch.tensor(golden["cases"][case]["prompt"], dtype=torch.long)
        seqs.append(dual_ar_sequence(case, prompt, len(golden["cases"][case]["frames"]), TOP_K_1))
        runner.admit(seqs[-1])
    outputs = run_to_end(runner, seqs)
    if graphs:
        assert not runner.graphs.uncapturable
    for case in CASES:
        expected = golden["cases"][case]["frames"]
        ends = next((i for i, frame in enumerate(expected) if frame[0] == golden["eos_id"]), None)
        assert _frames(outputs[case]) == expected[:ends], case


def test_seeded_sampled_requests_graphed_equal_eager(checkpoint: Path) -> None:
    """The official API's draw with repetition-aware sampling, seeded: four requests stepped together."""
    golden = json.loads(GOLDENS.read_text())
    spoken = {}
    for graphs in (False, True):
        runner = _runner(checkpoint, graphs, False)
        seqs = []
        for index, case in enumerate(CASES):
            prompt = torch.tensor(golden["cases"][case]["prompt"], dtype=torch.long)
            sampling = DEFAULT_SAMPLING.model_copy(update={"seed": 100 + index})
            seqs.append(dual_ar_sequence(case, prompt, 24, sampling, ignore_eos=True))
            runner.admit(seqs[-1])
        outputs = run_to_end(runner, seqs)
        spoken[graphs] = {case: _frames(outputs[case]) for case in CASES}
    assert all(len(frames) == 24 for frames in spoken[True].values())
    assert spoken[True] == spoken[False]


def test_the_stateful_codec_streams_the_one_shot_decode_on_the_gpu(checkpoint: Path) -> None:
    codec = load_codec(checkpoint, "cuda", torch.float32)
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, codec.config.semantic_codebook_size, (10, 48), generator=generator)
    whole = codec.decode(codes.cuda()).cpu()
    decoder = StatefulStreamingDecoder(StatefulS2ProCodec(codec, max_streams=2), ChunkSchedule((1, 2, 4), 8, 1))
    chunks = [chunk for index in range(codes.shape[1]) for chunk in decoder.push(codes[:, index : index + 1])]
    last = decoder.finish()
    streamed = torch.cat([chunk.cpu() for chunk in [*chunks, *([last] if last is not None else [])]])
    assert streamed.shape == whole.shape
    torch.testing.assert_close(streamed, whole, atol=1e-4, rtol=0)
