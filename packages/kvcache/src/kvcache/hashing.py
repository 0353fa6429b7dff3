"""Chained block hashes over full blocks.

``hash_i = H(hash_{i-1} or NONE_HASH, tokens of block i, extra_keys_i)``; only full
blocks are hashed, so a hash names the whole prefix up to and including its block.
Extra keys: ``("lora", lora_id)`` on every block of a LoRA request, then
``("cache_salt", salt)`` on the first block only (so salted requests share nothing
with others, yet the chain carries the salt to every later block).

Default ``H``: SHA-256 (collision-safe, deterministic across processes) over an
injective byte encoding: the 32-byte parent, the block's token ids as 8-byte
little-endian integers, then ``pickle(extra_keys)`` when there are any. A custom
``hash_fn`` receives the tuple ``(parent, tuple(token_ids), extra_keys)`` instead
(vLLM's convention) and must return bytes.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import Any

BlockHash = bytes
HashFn = Callable[[Any], bytes]

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_sha256 = hashlib.sha256


def sha256_hash(obj: Any) -> bytes:
    """SHA-256 digest of ``pickle.dumps(obj)``: a collision-safe ``hash_fn`` for any object."""
    return _sha256(pickle.dumps(obj, protocol=_PROTOCOL)).digest()


#: Parent of the first block: a fixed seed (vLLM 0.33 uses H(seed) with a fixed seed
#: string for cryptographic hashes), so hashes are reproducible across processes.
NONE_HASH: BlockHash = _sha256(b"kvcache-none-hash").digest()


def block_extra_keys(block_index: int, lora_id: Hashable | None, cache_salt: str | None) -> tuple | None:
    """Extra keys of block ``block_index``: LoRA on every block, the salt on block 0 only."""
    keys: tuple = ()
    if lora_id is not None:
        keys += (("lora", lora_id),)
    if cache_salt is not None and block_index == 0:
        keys += (("cache_salt", cache_salt),)
    return keys or None


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """The token ids as 8-byte little-endian integers (``struct`` packs a list about
    twice as fast as ``array`` converts one)."""
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error:
        return array("q", token_ids).tobytes()  # not int64s: raise array's TypeError/OverflowError


def _extra_bytes(extra_keys: tuple | None) -> bytes:
    return b"" if extra_keys is None else pickle.dumps(extra_keys, protocol=_PROTOCOL)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
    hash_fn: HashFn | None = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    if hash_fn is not None:
        return hash_fn((parent, tuple(token_ids), extra_keys))
    return _sha256(parent + _token_bytes(token_ids) + _extra_bytes(extra_keys)).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    lora_id: Hashable | None = None,
    cache_salt: str | None = None,
    hash_fn: HashFn | None = None,
) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``block_hashes``."""
    n_full = len(token_ids) // block_size
    first = len(block_hashes)
    if first >= n_full:
        return
    parent = block_hashes[-1] if block_hashes else NONE_HASH
    lora_key = (("lora", lora_id),) if lora_id is not None else None
    if hash_fn is not None:
        for i in range(first, n_full):
            extra = block_extra_keys(0, lora_id, cache_salt) if i == 0 else lora_key
            start = i * block_size
            parent = hash_fn((parent, tuple(token_ids[start : start + block_size]), extra))
            block_hashes.append(parent)
        return
    step = 8 * block_size
    data = _token_bytes(token_ids[first * block_size : n_full * block_size])
    tail = _extra_bytes(lora_key)
    pos = 0
    append = block_hashes.append
    if first == 0 and cache_salt is not None:
        head = _extra_bytes(block_extra_keys(0, lora_id, cache_salt))
        parent = _sha256(parent + data[:step] + head).digest()
        append(parent)
        pos = step
    end = len(data)
    while pos < end:
        parent = _sha256(parent + data[pos : pos + step] + tail).digest()
        append(parent)
        pos += step
