"""Qwen3-TTS's 12 Hz codec decoder on the shared streaming vocoder: the one-shot decode (its sample count, its
causality, the official offline chunking), streaming through the stateful and the window decoders against it, a
cloned voice's reference codes as the first chunk's left context and the official clone cut, batching across
streams, and loading the speech tokenizer's weights (tiny random decoder, fp32, CPU)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omni_ray.models.qwen3_tts.codec_decoder import (
    CodecDecoderConfig,
    Qwen3TTSCodecDecoder,
    clone_cut_samples,
    clone_lead_in,
    load_codec_decoder,
    make_codec,
)
from omni_ray.vocoder import ChunkSchedule, StatefulStreamingDecoder, StreamingDecoder, step_shapes
from omni_ray.vocoder.batching import BatchingCodec, BatchingStatefulCodec
from omni_ray.vocoder.code2wav import Code2WavCodec

SPF = 1920
Q = 16
TINY = CodecDecoderConfig(codebook_dim=32, latent_dim=64, hidden_size=32, head_dim=16, num_attention_heads=2,
                          num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2, decoder_dim=64)


def randomized(module: Qwen3TTSCodecDecoder, seed: int = 0) -> Qwen3TTSCodecDecoder:
    """Weights that make a waveform of about 0.2 RMS, rarely clipped: fan-in scaled matrices, codebooks of unit
    scale with uneven usage counts, Snake parameters and biases off their neutral values, layer scales at the
    official initial 0.01."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(param.shape, generator=generator)
            if leaf == "cluster_usage":
                param.copy_(torch.rand(param.shape, generator=generator) * 1.5 + 0.5)
            elif leaf == "embedding_sum":
                param.copy_(noise)
            elif leaf in ("alpha", "beta"):
                param.copy_(0.3 * noise)
            elif leaf == "scale":
                param.fill_(0.01)
            elif leaf == "gamma":
                param.copy_(0.05 + 0.2 * torch.rand(param.shape, generator=generator))
            elif param.dim() == 1:
                param.copy_((1.0 if "norm" in name else 0.0) + 0.05 * noise)
            else:
                gain = 0.75 if name.startswith("decoder.") else 1.0
                param.copy_(gain * noise / param[0].numel() ** 0.5)
    return module.eval()


@pytest.fixture(scope="module")
def module() -> Qwen3TTSCodecDecoder:
    return randomized(Qwen3TTSCodecDecoder(TINY))


@pytest.fixture(scope="module")
def codec(module: Qwen3TTSCodecDecoder) -> Code2WavCodec:
    return make_codec(module, max_streams=8)


def codes_of(frames: int, seed: int = 100) -> torch.Tensor:
    """Random codes [Q, frames]."""
    return torch.randint(0, 2048, (Q, frames), generator=torch.Generator().manual_seed(seed))


def one_shot(module: Qwen3TTSCodecDecoder, codes: torch.Tensor) -> torch.Tensor:
    """The offline decode of [Q, T] codes: T * 1920 samples."""
    return module.decode(codes.T)


def streamed(decoder: StreamingDecoder | StatefulStreamingDecoder, codes: torch.Tensor,
             bursts: list[int]) -> list[torch.Tensor]:
    """Push `codes` in bursts of the given sizes (then the rest), finish; every chunk emitted."""
    chunks, done = [], 0
    for size in bursts:
        chunks += decoder.push(codes[:, done : done + size])
        done += size
    chunks += decoder.push(codes[:, done:])
    last = decoder.finish()
    return chunks + ([last] if last is not None else [])


def snr_db(reference: torch.Tensor, estimate: torch.Tensor) -> float:
    error = (estimate - reference).pow(2).sum().clamp(min=1e-30)
    return 10 * math.log10(float(reference.pow(2).sum() / error))


# ---- the one-shot decode ------------------------------------------------------------------------------------------
def test_each_frame_is_1920_final_samples_and_nothing_is_held_back(module: Qwen3TTSCodecDecoder,
                                                                   codec: Code2WavCodec) -> None:
    """Strictly causal: a decode of T frames is T * 1920 samples, the first T * 1920 of any longer decode (so the
    shared vocoder's measured trim is 0, where Code2Wav's is 555)."""
    assert codec.trim == 0 and codec.samples_per_frame == SPF and codec.num_quantizers == Q
    codes = codes_of(12)
    whole = one_shot(module, codes)
    assert whole.shape == (12 * SPF,)
    for frames in (1, 5, 11):
        torch.testing.assert_close(one_shot(module, codes[:, :frames]), whole[: frames * SPF], rtol=0, atol=1e-5)
    assert 0.05 < whole.std() < 0.5 and (whole.abs() >= 1).float().mean() < 0.01  # a real signal, rarely clipped
    assert whole.abs().max() <= 1.0


def test_the_offline_decode_takes_chunks_after_left_context_like_the_official(module: Qwen3TTSCodecDecoder) -> None:
    """`decode` cuts long inputs into chunks decoded after `left_context` frames: with context reaching the start
    it equals one pass; with less, the first chunk is still exact and later ones differ (the context is shorter
    than the attention's reach). Batched rows decode as they do alone."""
    codes = codes_of(30, seed=5)
    with torch.inference_mode():
        one_pass = module(codes[None])[0, 0]
    full = module.decode(codes.T, chunk_frames=12, left_context=30)
    short = module.decode(codes.T, chunk_frames=12, left_context=2)
    assert full.shape == short.shape == one_pass.shape == (30 * SPF,)
    torch.testing.assert_close(full, one_pass, rtol=0, atol=1e-5)
    torch.testing.assert_close(short[: 12 * SPF], one_pass[: 12 * SPF], rtol=0, atol=1e-5)
    assert (short[12 * SPF :] - one_pass[12 * SPF :]).abs().max() > 1e-4
    batch = module.decode(torch.stack([codes.T, codes_of(30, seed=6).T]))
    torch.testing.assert_close(batch[0], one_pass, rtol=0, atol=1e-5)
    torch.testing.assert_close(batch[1], one_shot(module, codes_of(30, seed=6)), rtol=0, atol=1e-5)


# ---- streaming ----------------------------------------------------------------------------------------------------
def test_stateful_streaming_equals_the_one_shot_decode_past_the_attention_window(
        codec: Code2WavCodec, module: Qwen3TTSCodecDecoder) -> None:
    """The default decoder: 80 frames (past the 72-frame window) pushed unevenly, on the default ramp 1, 2, 4 then 8;
    the chunks add up to the one-shot decode, sample count included, and the slot is freed."""
    codes = codes_of(80, seed=7)
    stateful = BatchingStatefulCodec(codec)
    chunks = streamed(StatefulStreamingDecoder(stateful, ChunkSchedule()), codes, [1, 1, 3, 2, 9, 5, 13, 30])
    assert [c.numel() // SPF for c in chunks[:4]] == [1, 2, 4, 8]
    audio = torch.cat(chunks)
    assert audio.shape == (80 * SPF,)
    torch.testing.assert_close(audio, one_shot(module, codes), rtol=0, atol=1e-4)
    assert codec.states is not None and codec.states.in_use == 0


def test_window_decoding_with_full_context_equals_the_one_shot_and_at_16_frames_is_above_45_db(
        codec: Code2WavCodec, module: Qwen3TTSCodecDecoder) -> None:
    codes = codes_of(34, seed=8)
    whole = one_shot(module, codes)
    full = torch.cat(streamed(StreamingDecoder(codec, ChunkSchedule(left_context=34)), codes, [3, 10]))
    assert full.shape == whole.shape == (34 * SPF,)
    torch.testing.assert_close(full, whole, rtol=0, atol=1e-4)
    default = torch.cat(streamed(StreamingDecoder(codec, ChunkSchedule(left_context=16)), codes, [3, 10]))
    assert default.shape == whole.shape
    assert 45.0 <= snr_db(whole, default) < 200.0  # short context changes the samples, a little


# ---- voice clone --------------------------------------------------------------------------------------------------
def _clone_lengths() -> tuple[tuple[int, int], tuple[int, int]]:
    """(reference, generated) frame counts, small: one where the official cut is exactly the reference's share,
    one where its float truncation cuts a sample less."""
    exact = short = None
    for reference in range(3, 20):
        for generated in range(3, 20):
            cut = clone_cut_samples(reference, reference + generated)
            if cut == reference * SPF and exact is None:
                exact = (reference, generated)
            if cut == reference * SPF - 1 and short is None:
                short = (reference, generated)
    assert exact is not None and short is not None
    return exact, short


def test_the_official_clone_cut_is_one_sample_short_for_some_length_pairs() -> None:
    cuts = [clone_cut_samples(r, r + g) - r * SPF for r in range(1, 60) for g in range(1, 60)]
    assert set(cuts) == {0, -1}
    assert 0.01 < cuts.count(-1) / len(cuts) < 0.1
    assert clone_cut_samples(0, 10) == 0


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "window"])
@pytest.mark.parametrize("which", [0, 1], ids=["cut-exact", "cut-one-short"])
def test_a_cloned_voice_streams_the_official_clone_output(codec: Code2WavCodec, module: Qwen3TTSCodecDecoder,
                                                          stateful: bool, which: int) -> None:
    """The stream is opened with the reference codes; its chunks are the one-shot decode of [reference + generated]
    from the first generated frame on, and with `clone_lead_in` before them (none, or the one sample the official
    cut keeps for this length pair) they are the official clone output, sample for sample."""
    reference_frames, generated_frames = _clone_lengths()[which]
    reference, generated = codes_of(reference_frames, seed=20), codes_of(generated_frames, seed=21)
    total = reference_frames + generated_frames
    joined = one_shot(module, torch.cat([reference, generated], dim=1))
    official = joined[clone_cut_samples(reference_frames, total) :]
    if stateful:
        decoder: StreamingDecoder | StatefulStreamingDecoder = StatefulStreamingDecoder(
            BatchingStatefulCodec(codec), ChunkSchedule(), reference_codes=reference)
    else:
        decoder = StreamingDecoder(codec, ChunkSchedule(left_context=total), reference_codes=reference)
    audio = torch.cat(streamed(decoder, generated, [2, 5]))
    assert audio.shape == (generated_frames * SPF,)
    torch.testing.assert_close(audio, joined[reference_frames * SPF :], rtol=0, atol=1e-4)
    lead_in = clone_lead_in(decoder, generated_frames)
    assert lead_in.numel() == which
    whole = torch.cat([lead_in, audio])
    assert whole.shape == official.shape
    torch.testing.assert_close(whole, official, rtol=0, atol=1e-4)


def test_reference_codes_decode_in_the_shapes_the_schedule_declares(codec: Code2WavCodec) -> None:
    """A cloned stream's codec calls (reference priming included) are all among `step_shapes(reference=True)`, so a
    GPU codec captures every graph it needs at warm-up; without a reference the shapes are the plain ones."""
    schedule = ChunkSchedule()
    seen: list[tuple[int, bool]] = []

    class Recording(BatchingStatefulCodec):
        def step(self, codes: torch.Tensor, position: int, slot: int, first: bool) -> torch.Tensor:
            seen.append((int(codes.shape[1]), first))
            return super().step(codes, position, slot, first)

    for reference_frames in (1, 7, 13):
        decoder = StatefulStreamingDecoder(Recording(codec), schedule, reference_codes=codes_of(reference_frames))
        streamed(decoder, codes_of(6, seed=3), [1, 2])
    assert set(seen) <= set(step_shapes(schedule, reference=True))
    assert seen[0][1] and (1, False) in seen
    assert set(step_shapes(schedule)) < set(step_shapes(schedule, reference=True))
    unstarted = StatefulStreamingDecoder(BatchingStatefulCodec(codec), schedule, reference_codes=codes_of(2))
    with pytest.raises(ValueError, match="reference samples"):
        unstarted.reference_tail(1)  # nothing decoded yet
    unstarted.close()
    assert codec.states is not None and codec.states.in_use == 0


# ---- batching across streams -------------------------------------------------------------------------------------
def test_concurrent_streams_decode_in_shared_batches_each_equal_to_its_own_one_shot(
        codec: Code2WavCodec, module: Qwen3TTSCodecDecoder) -> None:
    """Four streams (one a cloned voice) on one event loop through the decode thread: frames arrive a step at a
    time, the calls of one step run as one batched call, and every stream gets its own one-shot samples."""
    batching = BatchingStatefulCodec(codec, max_batch=8, gather_s=0.02)
    frames = [14, 14, 11, 9]
    streams = [codes_of(n, seed=40 + i) for i, n in enumerate(frames)]
    reference = codes_of(5, seed=50)

    async def run(index: int) -> torch.Tensor:
        decoder = StatefulStreamingDecoder(batching, ChunkSchedule(),
                                           reference_codes=reference if index == 3 else None)
        chunks = []
        for step in range(frames[index]):
            chunks += await decoder.push_async(streams[index][:, step : step + 1], None, batching.worker.submit_nowait)
            await asyncio.sleep(0)
        last = await decoder.finish_async(batching.worker.submit_nowait)
        return torch.cat(chunks + ([last] if last is not None else []))

    async def run_all() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(run(i) for i in range(4))))

    outputs = asyncio.run(run_all())
    for index, audio in enumerate(outputs[:3]):
        torch.testing.assert_close(audio, one_shot(module, streams[index]), rtol=0, atol=1e-4)
    cloned = one_shot(module, torch.cat([reference, streams[3]], dim=1))[5 * SPF :]
    torch.testing.assert_close(outputs[3], cloned, rtol=0, atol=1e-4)
    assert batching.worker.batches < batching.worker.windows  # some calls did run together


def test_window_decodes_of_several_streams_batch_by_window_length(codec: Code2WavCodec,
                                                                  module: Qwen3TTSCodecDecoder) -> None:
    batching = BatchingCodec(codec, max_batch=4)
    windows = torch.stack([codes_of(6, seed=60), codes_of(6, seed=61)])
    both = codec.decode_batch(windows)
    assert both.shape == (2, 6 * SPF)
    for row in range(2):
        torch.testing.assert_close(both[row], one_shot(module, windows[row]), rtol=0, atol=1e-5)
    torch.testing.assert_close(batching.decode(windows[1]), both[1], rtol=0, atol=1e-5)


# ---- loading -----------------------------------------------------------------------------------------------------
def write_speech_tokenizer(module: Qwen3TTSCodecDecoder, directory: Path, decoder_config: dict[str, object]) -> Path:
    """A speech tokenizer directory holding this decoder's weights under the official ``decoder.`` names."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"decoder_config": decoder_config}))
    tensors = {f"decoder.{key}": value.contiguous() for key, value in module.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


TINY_JSON: dict[str, object] = {
    "codebook_dim": 32, "latent_dim": 64, "hidden_size": 32, "head_dim": 16, "num_attention_heads": 2,
    "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2, "decoder_dim": 64,
    "codebook_size": 2048, "num_quantizers": 16, "sliding_window": 72, "rope_theta": 10000,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "semantic_codebook_size": 4096,
}


def test_the_decoder_loads_from_a_checkpoints_speech_tokenizer(module: Qwen3TTSCodecDecoder, tmp_path: Path) -> None:
    """Read from ``<checkpoint>/speech_tokenizer/`` (its config's ``decoder_config``, keys it does not know ignored);
    the loaded decoder decodes as the one saved; a missing tensor is an error."""
    write_speech_tokenizer(module, tmp_path / "speech_tokenizer", TINY_JSON)
    loaded = load_codec_decoder(tmp_path)
    assert loaded.decoder_config == TINY
    codes = codes_of(4, seed=70)
    torch.testing.assert_close(one_shot(loaded, codes), one_shot(module, codes), rtol=0, atol=0)
    broken = dict(module.state_dict())
    broken.pop("quantizer.rvq_rest.vq.layers.14._codebook.embedding_sum")
    save_file({f"decoder.{k}": v.contiguous() for k, v in broken.items()},
              str(tmp_path / "speech_tokenizer" / "model.safetensors"))
    with pytest.raises(KeyError, match="embedding_sum"):
        load_codec_decoder(tmp_path)


def test_the_codebooks_are_usage_normalised_sums_projected_per_group(module: Qwen3TTSCodecDecoder) -> None:
    """Codebook rows are ``embedding_sum / cluster_usage``; the 15 acoustic rows are summed before their projection,
    and the semantic group's projection is added."""
    codes = codes_of(3, seed=80)[None]
    quantizer = module.quantizer

    def group(part: torch.nn.Module, group_codes: torch.Tensor) -> torch.Tensor:
        books = [layer._codebook for layer in part.vq.layers]
        rows = sum(book.embedding_sum[group_codes[:, i]] / book.cluster_usage[group_codes[:, i], None]
                   for i, book in enumerate(books))
        return torch.einsum("oi,bti->bot", part.output_proj.weight[..., 0], rows)

    expected = group(quantizer.rvq_first, codes[:, :1]) + group(quantizer.rvq_rest, codes[:, 1:])
    with torch.no_grad():
        torch.testing.assert_close(quantizer.decode(codes), expected, rtol=1e-5, atol=1e-5)


# ---- the committed goldens (the official package's outputs on the tiny checkpoints) -----------------------------
GOLDENS = Path(__file__).parent / "goldens" / "qwen3_tts"
_DECODERS: dict[tuple[str, int], Qwen3TTSCodecDecoder] = {}


def golden_cases(seed: int) -> list[dict[str, object]]:
    import json

    path = GOLDENS / f"seed{seed}" / "cases.json"
    return json.loads(path.read_text(encoding="utf-8"))["cases"] if path.is_file() else []


def tiny_decoder(variant: str, seed: int) -> Qwen3TTSCodecDecoder:
    """The decoder of the tiny checkpoint the goldens were made on (``make-tiny``, cached)."""
    from omni_ray.models.qwen3_tts.checkpoint import ensure_tiny_checkpoint

    if (variant, seed) not in _DECODERS:
        _DECODERS[variant, seed] = load_codec_decoder(ensure_tiny_checkpoint(variant, seed))
    return _DECODERS[variant, seed]


GOLDEN_CASES = [(seed, case["key"]) for seed in (0, 1) for case in golden_cases(seed)]


@pytest.mark.skipif(not GOLDEN_CASES, reason="no goldens under tests/goldens/qwen3_tts/")
@pytest.mark.parametrize(("seed", "key"), GOLDEN_CASES)
def test_each_golden_cases_codes_decode_to_its_waveform_one_shot_and_streamed(seed: int, key: str) -> None:
    """The golden's codes (after its reference codes, cut as the official clone cuts) decode to the golden waveform:
    one-shot, streamed through the stateful decoder (with the clone lead-in), and at the default left context 16
    through the window decoder above 45 dB."""
    from safetensors.torch import load_file

    case = next(c for c in golden_cases(seed) if c["key"] == key)
    golden = load_file(str(GOLDENS / f"seed{seed}" / "waveforms.safetensors"))[key]
    module = tiny_decoder(str(case["variant"]), seed)
    codec = make_codec(module, max_streams=2)
    generated = torch.tensor(case["codes"]).T
    reference = torch.tensor(case["ref_codes"]).T if case.get("ref_codes") else None
    joined = generated if reference is None else torch.cat([reference, generated], dim=1)
    cut = 0 if reference is None else clone_cut_samples(reference.shape[1], joined.shape[1])
    if reference is not None:
        assert cut == case["ref_cut_samples"]
    one = one_shot(module, joined)[cut:]
    assert one.shape == golden.shape
    assert (one - golden).abs().max() <= 1e-4

    stream = StatefulStreamingDecoder(BatchingStatefulCodec(codec), ChunkSchedule(), reference_codes=reference)
    audio = torch.cat(streamed(stream, generated, [1, 2]))
    lead_in = clone_lead_in(stream, generated.shape[1]) if reference is not None else torch.zeros(0)
    whole = torch.cat([lead_in, audio])
    assert whole.shape == golden.shape
    assert (whole - golden).abs().max() <= 1e-4

    window = StreamingDecoder(codec, ChunkSchedule(left_context=16), reference_codes=reference)
    windowed = torch.cat([lead_in, *streamed(window, generated, [1, 2])])
    assert windowed.shape == golden.shape and snr_db(golden, windowed) >= 45.0


# ---- against the official package (opt-in: its venv) ------------------------------------------------------------
def official_python() -> Path | None:
    import os

    python = Path(os.environ.get("QWEN_TTS_VENV", "/work/venv-qwen-tts")) / "bin" / "python"
    return python if python.is_file() else None


# Run by the official venv's python: argv = checkpoint dir, input file, output file. The input holds `decode`
# ([T, 16] code tensors) and `clone` ((reference [R, 16], generated [G, 16]) pairs); the output, the official
# speech tokenizer's decode of each and `generate_voice_clone`'s waveform for each pair (its Talker replaced by
# one that returns the given frames, so that the official decode-and-cut runs on them).
OFFICIAL_SCRIPT = r"""
import sys, torch
from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer
torch.set_num_threads(1)
checkpoint, source, target = sys.argv[1:4]
inputs = torch.load(source)
tokenizer = Qwen3TTSTokenizer.from_pretrained(checkpoint + "/speech_tokenizer")
decoded = [torch.from_numpy(tokenizer.decode([{"audio_codes": codes}])[0][0]) for codes in inputs["decode"]]
tts = Qwen3TTSModel.from_pretrained(checkpoint)
cloned = []
for reference, generated in inputs["clone"]:
    tts.model.generate = lambda frames=generated, **_: ([frames], None)
    wavs, rate = tts.generate_voice_clone(text="Hello there.", language="Auto",
                                          voice_clone_prompt={"ref_code": [reference]})
    assert rate == 24000
    cloned.append(torch.from_numpy(wavs[0]))
torch.save({"decode": decoded, "clone": cloned}, target)
"""


@pytest.mark.skipif(official_python() is None, reason="opt-in fidelity check: the official qwen-tts venv is absent "
                    "(tests/goldens/qwen3_tts/make_venv.sh builds it; QWEN_TTS_VENV points at another)")
@pytest.mark.parametrize("seed", [0, 3])
def test_equal_to_the_official_decoder_and_clone_cut_on_a_tiny_checkpoint(seed: int, tmp_path: Path) -> None:
    """On a tiny Base checkpoint (`seed`): the official speech tokenizer's decode of 100 frames (one pass) and of 330
    (chunks of 300 after 25 frames of context) equals our one-shot decode, and the 100 our stateful stream; the
    official voice clone output (decode of reference + generated, its float cut) equals our cloned stream with its
    lead-in, for a length pair cut exactly and one cut a sample short."""
    import subprocess

    from omni_ray.models.qwen3_tts.checkpoint import ensure_tiny_checkpoint

    checkpoint = ensure_tiny_checkpoint("base", seed)
    module = load_codec_decoder(checkpoint)
    decode = [codes_of(100, seed=seed + 1).T, codes_of(330, seed=seed + 2).T]
    pairs = [(codes_of(r, seed=seed + 3).T, codes_of(g, seed=seed + 4).T) for r, g in _clone_lengths()]
    (tmp_path / "script.py").write_text(OFFICIAL_SCRIPT)
    torch.save({"decode": decode, "clone": pairs}, tmp_path / "in.pt")
    run = subprocess.run([str(official_python()), str(tmp_path / "script.py"), str(checkpoint),
                          str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    official = torch.load(tmp_path / "out.pt")

    for codes, theirs in zip(decode, official["decode"]):
        ours = module.decode(codes)
        assert ours.shape == theirs.shape == (codes.shape[0] * SPF,)
        assert (ours - theirs).abs().max() <= 1e-4 and theirs.std() > 0.01
    codec = make_codec(module, max_streams=2)
    stream = torch.cat(streamed(StatefulStreamingDecoder(BatchingStatefulCodec(codec), ChunkSchedule()),
                                decode[0].T, [1, 2, 4, 8]))
    assert stream.shape == official["decode"][0].shape
    assert (stream - official["decode"][0]).abs().max() <= 1e-4

    for (reference, generated), theirs in zip(pairs, official["clone"]):
        decoder = StatefulStreamingDecoder(BatchingStatefulCodec(codec), ChunkSchedule(), reference_codes=reference.T)
        audio = torch.cat(streamed(decoder, generated.T, [1, 2]))
        ours = torch.cat([clone_lead_in(decoder, generated.shape[0]), audio])
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max() <= 1e-4
    assert [t.numel() - g.shape[0] * SPF for (_, g), t in zip(pairs, official["clone"])] == [0, 1]
