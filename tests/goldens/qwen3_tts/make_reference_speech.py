"""Synthesise the goldens' reference speech with eSpeak NG (the ``espeakng-loader`` wheel bundles it) at 24 kHz."""

from __future__ import annotations

import argparse
import ctypes
import wave
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
TARGET_RATE = 24000
AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def synthesise(text: str) -> tuple[np.ndarray, int]:
    """eSpeak NG's default English voice speaking ``text``: int16 samples and their rate."""
    import espeakng_loader

    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    data_parent = str(Path(espeakng_loader.get_data_path()).parent).encode()
    rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, ctypes.c_char_p(data_parent), 0)
    if rate <= 0:
        raise RuntimeError("espeak_Initialize failed")
    chunks: list[np.ndarray] = []

    def collect(samples: ctypes.POINTER(ctypes.c_short), count: int, _events: ctypes.c_void_p) -> int:
        if count > 0:
            chunks.append(np.ctypeslib.as_array(samples, shape=(count,)).copy())
        return 0

    callback = SYNTH_CALLBACK(collect)
    lib.espeak_SetSynthCallback(callback)
    if lib.espeak_SetVoiceByName(b"en") != 0:
        raise RuntimeError("eSpeak NG has no 'en' voice")
    encoded = text.encode("utf-8")
    status = lib.espeak_Synth(encoded, len(encoded) + 1, 0, POS_CHARACTER, 0, 0, None, None)
    if status != 0:
        raise RuntimeError(f"espeak_Synth failed ({status})")
    lib.espeak_Synchronize()
    return np.concatenate(chunks), int(rate)


def to_24k(samples: np.ndarray, rate: int) -> np.ndarray:
    """Float32 in [-1, 1] at 24 kHz, peak-normalised to 0.5 (the rate the speech tokenizer and x-vector read)."""
    audio = samples.astype(np.float64) / 32768.0
    if rate != TARGET_RATE:
        g = np.gcd(rate, TARGET_RATE)
        audio = resample_poly(audio, TARGET_RATE // g, rate // g)
    audio = audio / max(float(np.abs(audio).max()), 1e-9) * 0.5
    return audio.astype(np.float32)


def write_wav(path: Path, audio: np.ndarray) -> None:
    """16-bit PCM mono wav at 24 kHz."""
    pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(TARGET_RATE)
        out.writeframes(pcm.tobytes())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "reference.wav"))
    args = parser.parse_args()
    samples, rate = synthesise(REFERENCE_TEXT)
    audio = to_24k(samples, rate)
    write_wav(Path(args.out), audio)
    print(f"wrote {args.out}: {audio.size / TARGET_RATE:.2f} s from eSpeak NG at {rate} Hz")
