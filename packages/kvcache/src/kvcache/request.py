"""The request as the cache manager sees it: token ids, progress, block hashes."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from kvcache.hashing import BlockHash, HashFn, extend_block_hashes


class Request:
    """A sequence whose KV the manager caches.

    ``num_computed_tokens`` is advanced by the caller (the scheduler) after each
    ``allocate_slots`` and reset to 0 on preemption. ``block_hashes`` holds the
    chained hash of every full block of ``all_token_ids``; it is filled when a
    manager first sees the request (which fixes the block size) and extended by
    ``append_output_token_ids``. Hashes survive preemption.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "cache_salt",
        "lora_id",
        "block_hashes",
        "_hash_block_size",
        "_hash_fn",
        "_num_admissions",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        cache_salt: str | None = None,
        lora_id: Hashable | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError("cache_salt must be a str or None")
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.block_hashes: list[BlockHash] = []
        self._hash_block_size = 0
        self._hash_fn: HashFn | None = None
        self._num_admissions = 0  # set by the manager; > 1 means resumed after preemption

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens; newly completed blocks get their hashes."""
        all_ids = self.all_token_ids
        if isinstance(token_ids, int):  # one sampled token: the decode step
            self.output_token_ids.append(token_ids)
            all_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self.output_token_ids.extend(token_ids)
            all_ids.extend(token_ids)
        bs = self._hash_block_size
        if bs and len(all_ids) // bs > len(self.block_hashes):
            self._extend_hashes()

    def bind_hasher(self, block_size: int, hash_fn: HashFn | None = None) -> None:
        """Fix the block size and hash function (None: the default SHA-256) of
        ``block_hashes``; done by the manager on first contact."""
        if not self._hash_block_size:
            self._hash_block_size = block_size
            self._hash_fn = hash_fn
            self._extend_hashes()
        elif self._hash_block_size != block_size or self._hash_fn is not hash_fn:
            raise ValueError(
                f"request {self.request_id!r} is already hashed with block size "
                f"{self._hash_block_size} and {self._hash_fn!r}"
            )

    def _extend_hashes(self) -> None:
        extend_block_hashes(
            self.block_hashes,
            self.all_token_ids,
            self._hash_block_size,
            self.lora_id,
            self.cache_salt,
            self._hash_fn,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
