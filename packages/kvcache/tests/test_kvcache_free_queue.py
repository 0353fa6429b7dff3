import pytest
from kvcache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(q):
    return [b.block_id for b in q.get_all_free_blocks()]


def test_initial_order_and_lazy_creation():
    blocks = []
    q = FreeKVCacheBlockQueue(blocks, num_blocks=6)
    assert blocks == [] and q.num_free_blocks == 6
    assert q.get_all_free_block_ids() == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    assert [b.block_id for b in blocks] == [0]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    assert q.get_all_free_block_ids() == [3, 4, 5]
    assert ids(q) == [3, 4, 5] and [b.block_id for b in blocks] == list(range(6))


def test_eager_blocks_list():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3]
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3] and q.num_free_blocks == 3
    q.append(blocks[2])
    assert ids(q) == [0, 1, 3, 2]


def test_append_prepend_around_fresh_run():
    blocks = []
    q = FreeKVCacheBlockQueue(blocks, num_blocks=8)
    a, b, c = q.popleft_n(3)  # 0, 1, 2
    q.append_n([b, a])
    q.prepend_n([c])
    assert q.get_all_free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert [x.block_id for x in q.popleft_n(7)] == [2, 3, 4, 5, 6, 7, 1]
    assert q.get_all_free_block_ids() == [0] and q.num_free_blocks == 1
    q.remove(a)
    assert q.num_free_blocks == 0 and q.get_all_free_block_ids() == []
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)


def test_popleft_n_spanning_front_fresh_back():
    blocks = []
    q = FreeKVCacheBlockQueue(blocks, num_blocks=5)
    first = q.popleft_n(2)  # 0, 1
    q.prepend_n([first[1]])
    q.append_n([first[0]])
    assert q.get_all_free_block_ids() == [1, 2, 3, 4, 0]
    got = q.popleft_n(5)
    assert [x.block_id for x in got] == [1, 2, 3, 4, 0]
    assert all(x.prev_free_block is None and x.next_free_block is None for x in got)
    q.append_n(got)
    assert ids(q) == [1, 2, 3, 4, 0]


def test_remove_unlinked_block_raises():
    q = FreeKVCacheBlockQueue([], num_blocks=3)
    block = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(block)


def test_million_block_pool_is_lazy():
    pool = BlockPool(1_000_000)
    assert len(pool.blocks) == 1 and pool.get_num_free_blocks() == 999_999
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert len(pool.blocks) == 4
