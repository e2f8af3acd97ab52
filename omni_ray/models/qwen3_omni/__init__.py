"""Qwen3-Omni: AuT encoder → Thinker (MoE LLM) → Talker (MoE) + MTP code predictor → Code2Wav."""
