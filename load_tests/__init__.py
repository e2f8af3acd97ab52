"""Async load generator and metrics for omni-ray's OpenAI-compatible HTTP API."""
