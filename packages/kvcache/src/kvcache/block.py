"""The physical KV cache block, as the manager sees it (no tensor data)."""

from __future__ import annotations


class KVCacheBlock:
    """One block of ``block_size`` token slots in the paged KV cache.

    ``ref_cnt`` counts the requests holding the block (0 = free, possibly still cached).
    ``block_hash`` is set only when the block is full *and* registered in the prefix
    cache; ``group_id`` is the KV cache group whose cache map holds it.
    ``prev_free_block``/``next_free_block`` are intrusive links owned by the free queue.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_id",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = -1
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def reset_hash(self) -> None:
        """Forget the cache registration (on eviction)."""
        self.block_hash = None
        self.group_id = -1

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self.block_hash is not None}{', null' if self.is_null else ''})"
        )
