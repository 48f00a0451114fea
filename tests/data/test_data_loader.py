"""BatchLoader ordering contract: layout invariance, epochs, resume, eval batches."""

import numpy as np
import pytest
import torch

from optimus.config import ConfigError
from optimus.data import BatchLoader, DataError, eval_batches
from optimus.data.order import global_indices, permute
from optimus.data.windows import TokenWindows

SEQ = 8


def _windows(n_windows: int) -> TokenWindows:
    return TokenWindows(np.arange(n_windows * SEQ + 1, dtype=np.int64), SEQ)  # window i starts with token i*SEQ


def _steps(ds, gb, mb, rank, world, seed, n_steps, consumed=0, prefetch=4):
    loader = BatchLoader(ds, gb, mb, rank, world, seed, samples_consumed=consumed, prefetch=prefetch)
    try:
        return [loader.next_step() for _ in range(n_steps)]
    finally:
        loader.close()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permute_is_a_bijection(n):
    p = permute(np.arange(n), n, (3, 1))
    assert sorted(p.tolist()) == list(range(n))


def test_permute_depends_on_key():
    a, b, c = (permute(np.arange(500), 500, k) for k in [(0, 0), (0, 1), (1, 0)])
    assert (a != b).any() and (a != c).any() and (b != c).any()


def test_windows_are_strided_slices_of_the_stream():
    stream = np.random.default_rng(0).integers(0, 1000, size=100)
    ds = TokenWindows(stream, SEQ)
    assert len(ds) == (100 - 1) // SEQ
    for i in range(len(ds)):
        assert ds[i].tolist() == stream[i * SEQ : i * SEQ + SEQ + 1].tolist()
    assert torch.equal(ds.gather(np.array([3, 0, 3])), torch.stack([ds[3], ds[0], ds[3]]))


def test_each_epoch_visits_every_window_once_in_a_new_order():
    ds = _windows(40)
    pos = np.arange(3 * 40)
    idx = global_indices(ds, 5, pos).reshape(3, 40)
    for epoch in idx:
        assert sorted(epoch.tolist()) == list(range(40))
    assert (idx[0] != idx[1]).any() and (idx[1] != idx[2]).any()
    assert (global_indices(ds, 6, pos[:40]) != idx[0]).any()


@pytest.mark.parametrize("mb", [1, 2])
def test_union_of_ranks_is_identical_for_world_1_2_4(mb):
    ds, gb, seed, n_steps = _windows(37), 8, 11, 7  # 7 steps of 8 cross an epoch boundary of 37
    ref = _steps(ds, gb, mb, 0, 1, seed, n_steps)
    assert all(len(step) == gb // mb for step in ref)
    for world in (2, 4):
        per_rank = [_steps(ds, gb, mb, r, world, seed, n_steps) for r in range(world)]
        for s in range(n_steps):
            union = [m for r in range(world) for m in per_rank[r][s]]  # rank order = micro-batch order
            assert len(union) == len(ref[s])
            assert all(torch.equal(a, b) for a, b in zip(union, ref[s], strict=True))
    # The micro-batches are the global order cut in sequence.
    flat = torch.cat([torch.cat(step) for step in ref])  # [n_steps * gb, S + 1]
    expected = ds.gather(global_indices(ds, seed, np.arange(n_steps * gb)))
    assert torch.equal(flat, expected)


def test_resume_from_samples_consumed_gives_the_same_next_batches():
    ds = _windows(50)
    full = _steps(ds, 8, 2, 1, 2, seed=3, n_steps=9)
    loader = BatchLoader(ds, 8, 2, 1, 2, seed=3)
    for _ in range(4):
        loader.next_step()
    state = loader.state_dict()
    assert state == {"samples_consumed": 32}
    loader.next_step()  # moves past the saved point; loading the state must rewind
    loader.load_state_dict(state)
    again = [loader.next_step() for _ in range(5)]
    loader.close()
    fresh = _steps(ds, 8, 2, 1, 2, seed=3, n_steps=5, consumed=state["samples_consumed"])
    for a, b, c in zip(full[4:], again, fresh, strict=True):
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c, strict=True))


def test_synchronous_and_prefetching_loaders_agree():
    ds = _windows(20)
    a = _steps(ds, 4, 2, 0, 1, 0, 6, prefetch=0)
    b = _steps(ds, 4, 2, 0, 1, 0, 6, prefetch=2)
    assert all(torch.equal(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


def test_plain_sequence_dataset_is_accepted():
    items = [torch.full((SEQ + 1,), i) for i in range(10)]
    step = _steps(items, 4, 2, 0, 1, 0, 1)[0]
    assert [m.shape for m in step] == [torch.Size([2, SEQ + 1])] * 2
    assert len({int(m[i, 0]) for m in step for i in range(2)}) == 4


def test_errors_in_the_dataset_reach_the_consumer():
    class Broken:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise RuntimeError("disk on fire")

    loader = BatchLoader(Broken(), 2, 1, 0, 1, 0)
    with pytest.raises(RuntimeError, match="disk on fire"):
        loader.next_step()
    loader.close()


def test_bad_layouts_and_empty_datasets_are_refused():
    with pytest.raises(ConfigError, match="global_batch=6"):
        BatchLoader(_windows(10), 6, 2, 0, 2, 0)
    with pytest.raises(DataError, match="seq_len"):
        BatchLoader(TokenWindows(np.arange(4), SEQ), 2, 1, 0, 1, 0)


def test_eval_set_is_the_same_sequences_in_every_layout():
    """Every (world size, micro-batch) evaluates the same windows once each, with equal forwards per rank."""
    ds = _windows(11)
    ref = [row for batch, weight in eval_batches(ds, 7, 1, 0, 1) for row, w in zip(batch, weight) if w]
    assert len(ref) == 7
    for world in (1, 2, 3, 4):
        for micro_batch in (1, 2, 4):
            per_rank = [eval_batches(ds, 7, micro_batch, r, world) for r in range(world)]
            assert len({len(p) for p in per_rank}) == 1, "every rank must run the same number of forwards"
            assert all(batch.shape[0] == micro_batch for p in per_rank for batch, _ in p)
            kept = [row for p in per_rank for batch, weight in p for row, w in zip(batch, weight) if w]
            assert len(kept) == 7 and all(torch.equal(a, b) for a, b in zip(kept, ref))
    small = [w for _, weight in eval_batches(_windows(3), 8, 2, 0, 1) for w in weight]
    assert sum(small) == 3, "a held-out set smaller than asked for is used once, not wrapped around"
