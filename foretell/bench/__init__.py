"""Benchmarks: `foretell bench` (offline sweep over speculative configurations, with an optional
Hugging Face comparison) and `foretell bench serve` (load generator for OpenAI-compatible servers).

Heavy imports (torch, matplotlib, httpx) happen inside the functions that need them.
"""
