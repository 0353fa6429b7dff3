"""Second-half CUDA graphs: buckets, padding, fallback (CPU, emulated capture); capture/replay on CUDA."""

import pytest
import torch
from swiftkv_fast.worker.cuda_graph import SecondHalfGraphs, bucket_for, capture_sizes


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(9) == [1, 2, 4, 8, 16]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112]
    s = capture_sizes(256)
    assert s[-1] == 256 and all(b - a == 16 for a, b in zip(s[10:], s[11:]))
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_for():
    sizes = capture_sizes(20)  # [1, 2, 4, 8, 16, 24]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert bucket_for(25, sizes) is None
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


V = 5


class FakeSecondHalf:
    """Row-wise function of every input; records the batch sizes and padding rows it saw."""

    def __init__(self):
        self.calls = []

    def __call__(self, hidden, positions, seq_lens, block_tables):
        self.calls.append(
            (hidden.shape[0], seq_lens.clone(), [bt.clone() for bt in block_tables], positions.clone())
        )
        full, sliding = block_tables
        out = torch.stack(
            [
                hidden.float().sum(-1),
                positions.float(),
                seq_lens.float(),
                (full.float() * torch.arange(1, full.shape[1] + 1)).sum(-1),
                (sliding.float() * torch.arange(1, sliding.shape[1] + 1)).sum(-1) * 1000,
            ],
            dim=-1,
        )
        assert out.shape[-1] == V
        return out


def _inputs(n, width, seed=0, hidden=6):
    """Two kvcache groups (full + sliding window), as in a hybrid model."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, hidden, generator=g),
        torch.randint(0, 100, (n,), generator=g),
        torch.randint(1, 50, (n,), generator=g).int(),
        (
            torch.randint(1, 30, (n, width), generator=g).int(),
            torch.randint(0, 30, (n, width), generator=g).int(),
        ),
    )


def _runner(fn, **kw):
    args = dict(
        max_num_seqs=12,
        max_blocks_per_req=4,
        num_groups=2,
        hidden_size=6,
        dtype=torch.float32,
        device="cpu",
        emulate=True,
        num_warmup=1,
        pad_position=7,
    )
    args.update(kw)
    return SecondHalfGraphs(fn, **args)


def test_emulated_padding_and_unpadding():
    fn = FakeSecondHalf()
    r = _runner(fn)
    assert r.sizes == [1, 2, 4, 8, 16] and r.max_batch == 16
    r.capture()
    assert [c[0] for c in fn.calls] == [16, 8, 4, 2, 1]  # warm-up, largest first
    assert r.capture_seconds is not None
    fn.calls.clear()
    # an earlier, bigger step leaves stale rows/columns behind
    r.run(*_inputs(7, 4, seed=1))
    for n, width in [(3, 2), (1, 4), (8, 3), (5, 1)]:
        x = _inputs(n, width, seed=n)
        fn.calls.clear()
        out = r.run(*x)
        ((bs, seq, bts, pos),) = fn.calls
        assert bs == bucket_for(n, r.sizes) and out.shape == (n, V)
        torch.testing.assert_close(out, FakeSecondHalf()(*x))  # same as eager on the real rows
        assert (seq[n:] == 0).all() and (pos[n:] == 7).all()
        for bt in bts:
            assert bt.shape == (bs, 4) and (bt[n:] == 0).all() and (bt[:n, width:] == 0).all()
    assert r.counts["graph"] == 5 and r.counts["eager"] == 0


def test_every_bucket_returns_rows_of_one_logits_buffer():
    r = _runner(FakeSecondHalf())
    r.capture()
    assert r.logits.shape == (16, V) and r.logits.dtype == torch.float32
    first = r.run(*_inputs(3, 2, seed=1))
    assert first.data_ptr() == r.logits.data_ptr()
    kept = first.clone()
    x = _inputs(9, 4, seed=2)  # another bucket (16), same buffer
    second = r.run(*x)
    assert second.data_ptr() == r.logits.data_ptr()
    torch.testing.assert_close(second, FakeSecondHalf()(*x))
    assert not torch.equal(first, kept)  # valid until the next run, as documented


def test_fallbacks_to_eager():
    fn = FakeSecondHalf()
    r = _runner(fn)
    r.run(*_inputs(3, 2))  # the first run captures, then replays
    assert r.captured and r.counts == {"graph": 1, "eager": 0} and fn.calls[-1][0] == 4
    out = r.run(*_inputs(17, 2))  # larger than the largest bucket
    assert out.shape == (17, V) and fn.calls[-1][0] == 17
    out = r.run(*_inputs(3, 5))  # block table wider than captured
    assert out.shape == (3, V) and fn.calls[-1][0] == 3
    h, pos, seq, (full, sliding) = _inputs(3, 2)
    out = r.run(h, pos, seq, (full, torch.zeros(3, 5, dtype=torch.int32)))  # one group's table too wide
    assert out.shape == (3, V) and fn.calls[-1][0] == 3
    assert r.counts == {"graph": 1, "eager": 3}
    r.run(*_inputs(16, 4))
    assert r.counts["graph"] == 2
    with pytest.raises(ValueError, match="block tables"):
        r.run(h, pos, seq, (full,))


@pytest.mark.parametrize("kw", [dict(enforce_eager=True), dict(emulate=False)])  # CPU w/o emulate
def test_disabled_is_always_eager(kw):
    fn = FakeSecondHalf()
    r = _runner(fn, **kw)
    r.capture()
    assert not r.captured and fn.calls == []
    x = _inputs(3, 2)
    torch.testing.assert_close(r.run(*x), FakeSecondHalf()(*x))
    assert r.counts == {"graph": 0, "eager": 1} and fn.calls[-1][0] == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_capture_and_replay():
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.randn(6, 6, device=dev, generator=g)
    w2 = torch.randn(6, V, device=dev, generator=g)
    emb = torch.randn(64, 6, device=dev, generator=g)

    def second_half(hidden, positions, seq_lens, block_tables):
        h = torch.relu(hidden @ w1) + emb[positions] + seq_lens[:, None].float()
        h = h + emb[block_tables[0].long()].sum(1) - emb[block_tables[1].long()].sum(1)
        return h @ w2

    r = SecondHalfGraphs(
        second_half,
        max_num_seqs=10,
        max_blocks_per_req=3,
        num_groups=2,
        hidden_size=6,
        dtype=torch.float32,
        device=dev,
    )
    r.capture()
    assert r.captured and sorted(r._graphs) == [1, 2, 4, 8, 16]
    for n, width in [(3, 2), (9, 3), (1, 1), (16, 3), (20, 3), (2, 4)]:
        h, pos, seq, bts = _inputs(n, width, seed=n)
        x = [h.to(dev), (pos % 64).to(dev), seq.to(dev), tuple((bt % 64).to(dev) for bt in bts)]
        out = r.run(*x).clone()
        torch.testing.assert_close(out, second_half(*x))
    assert r.counts == {"graph": 4, "eager": 2}
