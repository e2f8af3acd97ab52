"""Qwen3-TTS: reference encoder (12 Hz codec encoder + ECAPA) → Talker + code predictor → 12 Hz codec decoder."""
