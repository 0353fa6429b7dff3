"""O(1) LRU queue of free blocks: an intrusive doubly linked list with sentinels.

The front is the next block to reuse (and, if it is still cached, to evict); the
back holds the most recently freed cached blocks.

Blocks that were never used are created lazily: ids ``len(blocks) .. num_blocks-1``
sit in the list as one *fresh run* (a single marker node) and are created, in id
order, only when popped, so a pool of a million blocks initialises in O(1). The run
is observably identical to a chain of its blocks: they were queued in id order, no
operation inserts into the middle of the list, and a fresh block can never be
removed from the middle (it has no hash, so no lookup can find it).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcache.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order.

    Args:
        blocks: blocks already created, all free, queued in list order. When
            ``num_blocks`` is larger, ``blocks[i].block_id`` must equal ``i`` and the
            missing ids are created on demand and appended to this same list, so
            ``blocks[block_id]`` is always the block once it exists.
        num_blocks: total number of blocks (default ``len(blocks)``: nothing lazy).

    >>> q = FreeKVCacheBlockQueue([], num_blocks=4)
    >>> [b.block_id for b in q.popleft_n(2)], q.num_free_blocks
    ([0, 1], 2)
    """

    __slots__ = ("num_free_blocks", "_blocks", "_head", "_tail", "_fresh", "_next_fresh", "_num_blocks")

    def __init__(self, blocks: list[KVCacheBlock], num_blocks: int | None = None) -> None:
        if num_blocks is None:
            num_blocks = len(blocks)
        if num_blocks < len(blocks):
            raise ValueError(f"num_blocks={num_blocks} < len(blocks)={len(blocks)}")
        if num_blocks > len(blocks) and any(b.block_id != i for i, b in enumerate(blocks)):
            raise ValueError("lazy block creation needs blocks[i].block_id == i")
        self._blocks = blocks
        self._num_blocks = num_blocks
        self._next_fresh = len(blocks)
        self.num_free_blocks = num_blocks
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._fresh = KVCacheBlock(-3)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        for block in blocks:
            self._link_before(block, self._tail)
        if num_blocks > len(blocks):
            self._link_before(self._fresh, self._tail)

    # -- linking ----------------------------------------------------------------------

    @staticmethod
    def _link_before(block: KVCacheBlock, nxt: KVCacheBlock) -> None:
        prev = nxt.prev_free_block
        block.prev_free_block = prev
        block.next_free_block = nxt
        prev.next_free_block = block  # type: ignore[union-attr]
        nxt.prev_free_block = block

    @staticmethod
    def _unlink(block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None

    def _create(self, n: int) -> list[KVCacheBlock]:
        """Create the next ``n`` fresh blocks; the caller unlinks the run when it empties."""
        start = self._next_fresh
        stop = start + n
        new = [KVCacheBlock(i) for i in range(start, stop)]
        self._blocks.extend(new)
        self._next_fresh = stop
        return new

    # -- queue operations -------------------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block; ``ValueError`` when empty."""
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.num_free_blocks -= 1
        if block is self._fresh:
            new = self._create(1)[0]
            if self._next_fresh == self._num_blocks:
                self._unlink(block)
            return new
        self._unlink(block)  # type: ignore[arg-type]
        return block  # type: ignore[return-value]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` front blocks, front first."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        head, fresh = self._head, self._fresh
        node = head.next_free_block
        remaining = n
        while remaining:
            if node is fresh:
                k = min(remaining, self._num_blocks - self._next_fresh)
                out.extend(self._create(k))
                remaining -= k
                if self._next_fresh == self._num_blocks:  # run exhausted: drop the marker
                    node = fresh.next_free_block
                    fresh.prev_free_block = fresh.next_free_block = None
                continue
            nxt = node.next_free_block  # type: ignore[union-attr]
            node.prev_free_block = node.next_free_block = None  # type: ignore[union-attr]
            out.append(node)  # type: ignore[arg-type]
            node = nxt
            remaining -= 1
        # Re-attach the remainder after the head (the fresh marker may be it).
        head.next_free_block = node
        node.prev_free_block = head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Remove ``block`` from anywhere in the queue (a cache hit on a free block)."""
        self._unlink(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        self._link_before(block, self._tail)
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` in order; the last one ends up at the back."""
        tail = self._tail
        prev = tail.prev_free_block
        n = 0
        for block in blocks:
            prev.next_free_block = block  # type: ignore[union-attr]
            block.prev_free_block = prev
            prev = block
            n += 1
        prev.next_free_block = tail  # type: ignore[union-attr]
        tail.prev_free_block = prev
        self.num_free_blocks += n

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, keeping their order (the first is reused first)."""
        head = self._head
        nxt = head.next_free_block
        prev = head
        n = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            n += 1
        prev.next_free_block = nxt
        nxt.prev_free_block = prev  # type: ignore[union-attr]
        self.num_free_blocks += n

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front to back (creates the lazy ones; for tests and tools)."""
        if self._next_fresh < self._num_blocks:
            after = self._fresh.next_free_block
            self._unlink(self._fresh)
            for block in self._create(self._num_blocks - self._next_fresh):
                self._link_before(block, after)  # type: ignore[arg-type]
        out = []
        node = self._head.next_free_block
        while node is not self._tail:
            out.append(node)
            node = node.next_free_block  # type: ignore[union-attr]
        return out

    def get_all_free_block_ids(self) -> list[int]:
        """Ids of every free block, front to back, without creating the lazy ones."""
        out: list[int] = []
        node = self._head.next_free_block
        while node is not self._tail:
            if node is self._fresh:
                out.extend(range(self._next_fresh, self._num_blocks))
            else:
                out.append(node.block_id)  # type: ignore[union-attr]
            node = node.next_free_block  # type: ignore[union-attr]
        return out
