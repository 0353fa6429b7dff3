"""Incremental detokenization for streaming (vLLM's `detokenize_incrementally`, by decoding windows).

Each update decodes a window of the last few tokens twice (with and without the newest ones) and
keeps the difference, so a token costs O(1) however long the output is. Text is released only when
it is final:
- a window whose text ends in U+FFFD (a UTF-8 character split across tokens) is not consumed until
  the character is complete;
- the last `max(len(stop)) - 1` characters are held back while the request runs, so no prefix of a
  stop string is ever sent: the engine (engine.stop) cuts the text before a stop string, and the
  string, found after each token, starts at most that many characters before the previous text's end.
At the end, `finish(final_text)` releases the rest of the engine's final text (`Request.output_text`),
so the deltas add up to exactly the text `LLM.generate` returns.
"""

from __future__ import annotations

from collections.abc import Callable

from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # released so far
        self._decoded = ""  # every complete character decoded so far
        self._prefix_offset = 0  # the window is token_ids[prefix_offset:]; ...
        self._read_offset = 0  # ... its text up to read_offset is already in _decoded

    def update(self, token_ids: list[int]) -> str:
        """All output token ids so far -> the newly released text (possibly "")."""
        ids = token_ids[self._prefix_offset :]
        prefix_text = self.decode(ids[: self._read_offset - self._prefix_offset])
        new_text = self.decode(ids)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._decoded += new_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return self._release(len(self._decoded) - self.holdback)

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the request's whole output text) after what was released."""
        if not final_text.startswith(self.text):  # a tokenizer whose pieces do not add up
            logger.warning("streamed text %r is not a prefix of the final text %r", self.text, final_text)
            return ""
        self._decoded = final_text
        return self._release(len(final_text))

    def _release(self, end: int) -> str:
        delta = self._decoded[len(self.text) : end] if end > len(self.text) else ""
        self.text += delta
        return delta
