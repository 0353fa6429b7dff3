"""Chained block hashes over full blocks.

``hash_i = H((hash_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))``.
``H`` is SHA-256 over a pickle of the tuple (collision-safe, deterministic across
processes); only full blocks are hashed, so a hash names the whole prefix up to and
including its block. Extra keys: ``("lora", lora_id)`` on every block of a LoRA
request, then ``("cache_salt", salt)`` on the first block only (so salted requests
share nothing with others, yet the chain carries the salt to every later block).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable, Sequence
from typing import Any

BlockHash = bytes
HashFn = Callable[[Any], bytes]

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def sha256_hash(obj: Any) -> bytes:
    """SHA-256 digest of ``pickle.dumps(obj)``: the default, collision-safe hash."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTOCOL)).digest()


#: Parent of the first block: a fixed seed (vLLM 0.33 uses H(seed) with a fixed seed
#: string for cryptographic hashes), so hashes are reproducible across processes.
NONE_HASH: BlockHash = hashlib.sha256(b"kvcache-none-hash").digest()


def block_extra_keys(block_index: int, lora_id: Hashable | None, cache_salt: str | None) -> tuple | None:
    """Extra keys of block ``block_index``: LoRA on every block, the salt on block 0 only."""
    keys: tuple = ()
    if lora_id is not None:
        keys += (("lora", lora_id),)
    if cache_salt is not None and block_index == 0:
        keys += (("cache_salt", cache_salt),)
    return keys or None


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
    hash_fn: HashFn = sha256_hash,
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    return hash_fn((NONE_HASH if parent_hash is None else parent_hash, tuple(token_ids), extra_keys))


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    lora_id: Hashable | None = None,
    cache_salt: str | None = None,
    hash_fn: HashFn = sha256_hash,
) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``block_hashes``."""
    n_full = len(token_ids) // block_size
    first = len(block_hashes)
    if first >= n_full:
        return
    parent = block_hashes[-1] if block_hashes else NONE_HASH
    lora_key = (("lora", lora_id),) if lora_id is not None else None
    for i in range(first, n_full):
        if i == 0 and cache_salt is not None:
            extra = block_extra_keys(0, lora_id, cache_salt)
        else:
            extra = lora_key
        start = i * block_size
        parent = hash_fn((parent, tuple(token_ids[start : start + block_size]), extra))
        block_hashes.append(parent)
