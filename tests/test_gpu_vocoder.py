"""GPU: the stateful vocoder replayed from CUDA graphs (state gathered and scattered inside the graph) streams a
one-shot decode, for several streams batched at different positions. Skipped without CUDA."""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_streaming_vocoder import SPF, TRIM, _codes, _tiny_code2wav

from omni_ray.vocoder import (ChunkSchedule, Code2WavCodec, StatefulStreamingDecoder, code2wav_state, convolutions,
                              step_shapes)
from omni_ray.vocoder.batching import BatchingStatefulCodec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("codes_on, folds, layout", [("cpu", "timed", "channels-last"), ("cuda", "timed", "channels-last"),
                                                     ("cpu", "always", "channels-last"),
                                                     ("cpu", "timed", "channel-by-channel")])
def test_graph_replayed_stateful_streams_equal_one_shot_decodes(codes_on: str, folds: str, layout: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Codes pushed from the host, and from the GPU as the same-GPU relay hands them over: those stay on the GPU,
    joined and batched on each thread's default stream, which the vocoder's own stream then waits for. The dilated
    convolutions as timed at warm-up (at these tiny shapes most likely cuDNN's own), and all folded. The activations
    channels last (the default), and channel by channel (the A/B setting): each dilated convolution met only its
    layout."""
    monkeypatch.setattr(convolutions, "_FOLD_FASTER", weakref.WeakKeyDictionary())
    monkeypatch.setattr(code2wav_state, "CHANNELS_LAST", layout == "channels-last")
    if folds == "always":
        monkeypatch.setattr(convolutions, "_fold_is_faster", lambda x, conv: True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    module = _tiny_code2wav().cuda()
    schedule = ChunkSchedule((1, 2, 4), 8, 25)
    codec = Code2WavCodec(module, cuda_graphs=True, max_streams=8)
    before = len(codec.graphs)  # construction measured the trim with one window graph
    codec.warmup([], 4, step_shapes(schedule))
    captured = len(codec.graphs)
    worker = BatchingStatefulCodec(codec, max_batch=4)
    lengths = (90, 41, 17, 64)  # past the 72-frame attention window, and partial last chunks

    def run(index: int) -> torch.Tensor:
        codes = _codes(lengths[index], seed=20 + index).to(codes_on)
        decoder = StatefulStreamingDecoder(worker, schedule)
        chunks = [c for start in range(0, lengths[index], 3) for c in decoder.push(codes[:, start : start + 3])]
        last = decoder.finish()
        return torch.cat(chunks + ([last] if last is not None else []))

    with ThreadPoolExecutor(max_workers=4) as pool:
        streamed = list(pool.map(run, range(4)))
    assert captured - before == 4 * 3  # 4 step shapes x row buckets 1, 2, 4
    assert len(codec.graphs) == captured  # every step the streams took replayed a warm-up graph
    for index, audio in enumerate(streamed):
        with torch.inference_mode():
            whole = module(_codes(lengths[index], seed=20 + index)[None].cuda()).flatten().cpu()
        assert audio.shape == whole.shape == (lengths[index] * SPF - TRIM,)
        torch.testing.assert_close(audio, whole, rtol=0, atol=1e-4)
    assert codec.states is not None and codec.states.in_use == 0
    dilated = [conv for conv in module.modules() if isinstance(conv, torch.nn.Conv1d) and conv.dilation[0] > 1]
    assert dilated and all(convolutions._FOLD_FASTER.get(conv) for conv in dilated)  # each met at warm-up and timed
    assert all(key[1] == (layout == "channels-last") for conv in dilated for key in convolutions._FOLD_FASTER[conv])
    if folds == "always":
        assert all(all(chosen.values()) for chosen in convolutions._FOLD_FASTER.values())
