"""The OpenAI-compatible HTTP server (`foretell serve`): FastAPI app, async engine front, metrics.

Nothing is imported here, so `foretell.server.cli` can register its flags without FastAPI.
"""
