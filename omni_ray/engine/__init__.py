"""Shared backbone-serving machinery: KV cache slots, sampling, continuous-batching loop."""
