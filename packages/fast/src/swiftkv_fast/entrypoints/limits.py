"""How much one request may ask of the server (no dependency beyond Python: the CLI reads these
defaults without the serve extra installed)."""

from __future__ import annotations

MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_SEQUENCES_PER_REQUEST = 2 * MAX_N  # default: sequences (prompts x n) of one request
BODY_BYTES_PER_TOKEN = 64  # the default body limit: far more JSON than a token of text takes
MIN_BODY_BYTES = 1 << 20


def default_max_request_body_bytes(max_model_len: int) -> int:
    """Room for a prompt of max_model_len tokens as JSON text with plenty to spare (escapes included)."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)
