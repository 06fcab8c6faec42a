"""The training order: a function of (seed, step), so a resumed run trains on the batches the
interrupted one would have, and ranks share an epoch without overlap."""

import pytest
import torch

from data import sampler as sampler_module
from data.sampler import RankShard, ResumableShuffle


def batches_of(order: list[int], size: int) -> list[list[int]]:
    return [order[start : start + size] for start in range(0, len(order), size)]


def batches(sampler: ResumableShuffle, epochs: int) -> list[list[int]]:
    return batches_of([i for _ in range(epochs) for i in sampler], sampler.batch_size)


def test_starting_at_any_batch_continues_the_same_order():
    straight = batches(ResumableShuffle(103, batch_size=4, seed=7), epochs=3)
    assert len(straight) == 3 * 25  # 103 // 4 full batches an epoch; the rest is dropped
    for start in (1, 24, 25, 26, 60):
        resumed = ResumableShuffle(103, batch_size=4, seed=7, start_batch=start)
        epochs_left = 3 - start // 25
        assert batches(resumed, epochs_left) == straight[start:]


def test_an_epoch_and_a_batch_in_it_start_where_the_same_count_of_batches_does():
    # A resumed run's loader starts at (epoch, batch of it): the data module's record.
    straight = batches(ResumableShuffle(103, batch_size=4, seed=7), epochs=3)
    for epoch, batch in ((0, 3), (1, 0), (1, 24), (2, 5)):
        resumed = ResumableShuffle(103, batch_size=4, seed=7, start_batch=batch, start_epoch=epoch)
        assert batches(resumed, 3 - epoch) == straight[epoch * 25 + batch :]


def test_the_order_is_the_seeded_permutation_whatever_the_chunks(monkeypatch):
    # A checkpoint's run resumes with the batches it was promised, which these are: the epoch's
    # permutation of torch.randperm, handed over in chunks of any size.
    permutation = torch.randperm(103, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    whole_chunks = batches(ResumableShuffle(103, batch_size=4, seed=7, start_batch=26), 1)
    assert whole_chunks == batches_of(permutation[4:100], 4)
    monkeypatch.setattr(sampler_module, "INDICES_PER_CHUNK", 7)  # boundaries inside batches
    assert batches(ResumableShuffle(103, batch_size=4, seed=7, start_batch=26), 1) == whole_chunks
    monkeypatch.undo()  # the real chunks, several of them, over torch.randperm's own order
    permutation = torch.randperm(70_000, generator=torch.Generator().manual_seed(3)).tolist()
    assert list(ResumableShuffle(70_000, batch_size=10, seed=3)) == permutation


def test_each_epoch_and_seed_has_its_own_permutation():
    first, second = batches(ResumableShuffle(100, batch_size=10, seed=1), epochs=2)[::10]
    other_seed = batches(ResumableShuffle(100, batch_size=10, seed=2), epochs=1)[0]
    assert first != second and first != other_seed
    epoch = [i for batch in batches(ResumableShuffle(100, batch_size=10, seed=1), 1) for i in batch]
    assert sorted(epoch) == list(range(100))


def test_length_is_a_whole_epoch_even_when_resuming_into_one():
    # Lightning counts the restored epoch's finished batches against this length.
    assert len(ResumableShuffle(103, batch_size=4, seed=0, start_batch=30)) == 25 * 4


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_split_each_epoch_without_overlap(world_size):
    ranks = range(world_size)
    shares = [set(ResumableShuffle(100, 4, seed=3, rank=r, world_size=world_size)) for r in ranks]
    assert len({len(s) for s in shares}) == 1  # every rank runs as many batches
    assert set.intersection(*shares) == set() and len(set.union(*shares)) > 100 - 4 * world_size


def test_evaluation_shards_cover_every_example_once():
    shards = [list(RankShard(10, rank, 3)) for rank in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
    assert shards == [list(RankShard(10, rank, 3)) for rank in range(3)]  # a fixed order
    assert list(RankShard(10)) != list(range(10))  # shuffled: see test_data.py


def test_no_full_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="make no full batch of data.batch_size=8 on each of 2"):
        ResumableShuffle(10, batch_size=8, seed=0, world_size=2)
