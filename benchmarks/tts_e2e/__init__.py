"""Qwen3-TTS's workloads for `benchmarks/e2e_serve.py` (a serve config of `family: qwen3_tts`) and their table."""
