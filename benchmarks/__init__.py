"""Benchmarks of omni-ray on GPUs (engine steps, end to end through HTTP) and the transformers baseline."""
