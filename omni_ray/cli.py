"""`omni-ray` command line: make-tiny (write the tiny checkpoint) and generate (stream a reply to text + wav)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import TextIO

import numpy as np


def _make_tiny(args: argparse.Namespace) -> int:
    if args.family == "qwen3_tts":
        from omni_ray.models.qwen3_tts.checkpoint import make_tiny_checkpoint as make_tts

        path = make_tts(Path(args.out), variant=args.variant or "custom_voice", seed=args.seed, size=args.size)
        print(f"wrote tiny Qwen3-TTS {args.variant or 'custom_voice'} ({args.size}) checkpoint to {path}")
        return 0
    if args.variant is not None:
        print("--variant applies to --family qwen3_tts only", file=sys.stderr)
        return 2
    if args.family == "s2_pro":
        from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint

        path = write_tiny_checkpoint(Path(args.out), seed=args.seed)
        print(f"wrote tiny S2 Pro checkpoint (Dual-AR, tokenizer, codec) to {path}")
        return 0
    from omni_ray.models.qwen3_omni.checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(Path(args.out), seed=args.seed)
    print(f"wrote tiny Qwen3-Omni checkpoint to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    reply_out = sys.stdout  # the reply's text alone: Ray prints its raylet's warnings to `sys.stdout`, sent to stderr
    with contextlib.redirect_stdout(sys.stderr):
        return _generate_to(args, reply_out)


def _generate_to(args: argparse.Namespace, reply_out: TextIO) -> int:
    import ray

    from omni_ray.audio import encode_wav
    from omni_ray.config import PipelineConfig
    from omni_ray.engine.sampler import SamplingParams
    from omni_ray.pipeline import AudioChunk, Finished, Pipeline, TextDelta

    config = PipelineConfig.from_yaml(args.config) if args.config else PipelineConfig()
    if args.family or args.variant:
        model = {**config.model.model_dump(), "family": args.family or config.model.family, "variant": args.variant}
        config = config.model_copy(update={"model": type(config.model).model_validate(model)})
    if args.checkpoint:
        config.model.path = Path(args.checkpoint)
    content: list[dict[str, object]] = [{"type": "text", "text": args.text}]
    if args.audio:
        data = base64.b64encode(Path(args.audio).read_bytes()).decode()
        content.insert(0, {"type": "input_audio", "input_audio": {"data": data, "format": Path(args.audio).suffix[1:]}})
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    pipeline = Pipeline(config)
    sampling = SamplingParams(temperature=0.0) if args.greedy else SamplingParams(temperature=0.7, top_p=0.8, seed=args.seed)
    talker = SamplingParams(temperature=0.0, repetition_penalty=1.05) if args.greedy else None

    if config.model.family == "qwen3_tts":  # a TTS model speaks the text itself
        events = pipeline.speak(args.text, **_speech_kwargs(args, talker))
    elif config.model.family == "s2_pro":
        events = pipeline.speak(args.text, **_s2_pro_kwargs(args))
    else:
        events = pipeline.generate(
            [{"role": "user", "content": content}], sampling=sampling, max_tokens=args.max_tokens,
            audio=not args.no_audio, speaker=args.voice, talker_sampling=talker, max_audio_frames=args.max_audio_frames,
        )

    rate = 24000  # the audio's sample rate: each family's own, as its chunks say

    async def run() -> tuple[list[np.ndarray], Finished | None]:
        nonlocal rate
        pcm: list[np.ndarray] = []
        final: Finished | None = None
        start = time.time()
        first_audio: float | None = None
        async for event in events:
            if isinstance(event, TextDelta):
                reply_out.write(event.text)
                reply_out.flush()
            elif isinstance(event, AudioChunk):
                first_audio = first_audio if first_audio is not None else event.t - start
                pcm.append(event.pcm)
                rate = event.sample_rate
            else:
                final = event
        reply_out.write("\n")
        if final is not None:
            print(f"[finish_reason={final.finish_reason} audio={final.audio_finish_reason} usage={final.usage}"
                  + (f" first_audio={first_audio:.3f}s" if first_audio is not None else "") + "]", file=sys.stderr)
        return pcm, final

    try:
        pcm, _ = asyncio.run(run())
    finally:
        pipeline.shutdown()
    if not args.no_audio:
        samples = np.concatenate(pcm) if pcm else np.zeros(0, dtype=np.float32)
        Path(args.out).write_bytes(encode_wav(samples, rate))
        print(f"wrote {len(samples) / rate:.2f} s of audio to {args.out}", file=sys.stderr)
    return 0


def _speech_kwargs(args: argparse.Namespace, talker: object) -> dict[str, object]:
    """A Qwen3-TTS `speak`'s arguments from the command line (a reference file's audio for a Base model)."""
    import soundfile as sf

    from omni_ray.engine.sampler import SamplingParams
    from omni_ray.reference_audio import ReferenceAudio

    kwargs: dict[str, object] = {"voice": args.voice, "language": args.language, "instructions": args.instructions,
                                 "max_audio_frames": args.max_audio_frames}
    if talker is not None:  # --greedy: the code predictor's draws too
        kwargs.update(sampling=talker, code_sampling=SamplingParams(temperature=0.0))
    if args.ref_audio:
        samples, rate = sf.read(args.ref_audio, dtype="float32", always_2d=True)  # at its own rate: encoded at 24 kHz
        kwargs["reference"] = ReferenceAudio(samples.mean(axis=1), int(rate), args.ref_text, x_vector_only=not args.ref_text)
    return kwargs


def _s2_pro_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """An S2 Pro `speak`'s arguments from the command line: a reference file and its transcript, or a stored voice."""
    import soundfile as sf

    from omni_ray.engine.sampler import SamplingParams
    from omni_ray.reference_audio import ReferenceAudio

    kwargs: dict[str, object] = {"voice": args.voice, "max_audio_frames": args.max_audio_frames}
    if args.greedy:
        kwargs["sampling"] = SamplingParams(temperature=0.0)
    elif args.seed is not None:
        from omni_ray.models.s2_pro.dual_ar_runner import DEFAULT_SAMPLING

        kwargs["sampling"] = DEFAULT_SAMPLING.model_copy(update={"seed": args.seed})
    if args.ref_audio:
        samples, rate = sf.read(args.ref_audio, dtype="float32", always_2d=True)  # resampled to 44.1 kHz to encode
        kwargs["references"] = [ReferenceAudio(samples.mean(axis=1), int(rate), args.ref_text)]
    return kwargs


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from omni_ray.serve.app import app_from_serve_config, start_serve, use_haproxy_front

    if args.haproxy:
        use_haproxy_front()

    config_path = Path(args.config) if args.config else Path(__file__).parent / "assets" / "serve_tiny_cpu.yaml"
    app, spec = app_from_serve_config(config_path)
    http = {**spec["http_options"], **({"host": args.host} if args.host else {}), **({"port": args.port} if args.port else {})}
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    ray.init(address=address) if address else ray.init(include_dashboard=False)
    start_serve(spec, http)
    print(f"omni-ray serving {spec['name']} at http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}{spec['route_prefix']}",
          file=sys.stderr)
    serve.run(app, name=spec["name"], route_prefix=spec["route_prefix"], blocking=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write a deterministic tiny random-weight checkpoint (official layout)")
    tiny.add_argument("--family", choices=("qwen3_omni", "qwen3_tts", "s2_pro"), default="qwen3_omni",
                      help="s2_pro: the Dual-AR's weights, config, tokenizer and codec")
    tiny.add_argument("--variant", choices=("base", "custom_voice", "voice_design"),
                      help="Qwen3-TTS variant (default custom_voice)")
    tiny.add_argument("--size", choices=("0b6", "1b7"), default="1b7",
                      help="Qwen3-TTS size kind: 1b7 keeps instructions for CustomVoice and a narrower code predictor")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny)
    gen = sub.add_parser("generate", help="stream one reply (text to stdout, audio to --out)")
    gen.add_argument("--config", help="pipeline YAML (default: the embedded tiny model on CPU)")
    gen.add_argument("--checkpoint", help="local checkpoint directory (overrides the config's model path)")
    gen.add_argument("--family", choices=("qwen3_omni", "qwen3_tts", "s2_pro"), default=None,
                     help="the model family (overrides the config's): qwen3_tts and s2_pro speak --text itself")
    gen.add_argument("--variant", choices=("base", "custom_voice", "voice_design"), default=None,
                     help="Qwen3-TTS: which tiny checkpoint (default custom_voice)")
    gen.add_argument("--language", default="auto", help="Qwen3-TTS: the language spoken, or auto")
    gen.add_argument("--instructions", default=None, help="Qwen3-TTS: how to speak (VoiceDesign: the voice itself)")
    gen.add_argument("--ref-audio", default=None,
                     help="Qwen3-TTS Base, S2 Pro: reference speech to clone the voice of")
    gen.add_argument("--ref-text", default=None,
                     help="Qwen3-TTS Base: the reference's transcript (in-context cloning); S2 Pro: needed with "
                          "--ref-audio")
    gen.add_argument("--text", required=True)
    gen.add_argument("--audio", help="input audio file (wav/flac/mp3, any rate and channel count)")
    gen.add_argument("--out", default="reply.wav")
    gen.add_argument("--no-audio", action="store_true", help="text-only reply")
    gen.add_argument("--voice", default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--max-audio-frames", type=int, default=None)
    gen.add_argument("--greedy", action="store_true")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ray-address", default=None, help="join an existing Ray cluster")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP service on Ray Serve")
    srv.add_argument("--config", help="Serve config YAML (default: the tiny CPU layout, deployments/tiny_cpu.yaml)")
    srv.add_argument("--host", default=None)
    srv.add_argument("--port", type=int, default=None)
    srv.add_argument("--ray-address", default=None, help="join an existing Ray cluster")
    srv.add_argument("--haproxy", action="store_true",
                     help="HTTP through Serve's HAProxy front, straight to the ingress replicas, instead of Serve's "
                          "Python proxy (a Ray cluster this command starts; one started elsewhere needs "
                          "RAY_SERVE_ENABLE_HA_PROXY=1 in its nodes' environment)")
    srv.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
