"""The HTTP entry point: an OpenAI-compatible server over `AsyncLLM` (`swiftkv serve`; see
api_server.py and docs/serving.md). Needs the `serve` extra (fastapi, uvicorn, prometheus-client)."""
