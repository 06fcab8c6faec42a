"""The training order: a function of (seed, step), so a resumed run trains on the batches the
interrupted one would have, and ranks share an epoch without overlap."""

import pytest
import torch

from data import sampler as sampler_module
from data.sampler import (
    SEED_PLUS_EPOCH,
    SEED_STREAM,
    RankShard,
    ResumableLoader,
    ResumableShuffle,
)


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
    # A checkpoint's run resumes with the batches it was promised, which these are: the epochs'
    # permutations of torch.randperm, one after another from a generator seeded with the seed,
    # handed over in chunks of any size.
    stream = torch.Generator().manual_seed(7)
    torch.randperm(103, generator=stream)  # epoch 0's
    permutation = torch.randperm(103, generator=stream).tolist()  # epoch 1's
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


def test_no_two_seeds_or_epochs_share_an_order():
    # Drawn from seed + epoch, seed 1's epoch 0 was seed 0's epoch 1: a seed sweep's runs
    # trained on shifted copies of one another's orders.
    orders = {}
    for seed in range(5):
        epochs = batches(ResumableShuffle(100, batch_size=100, seed=seed), epochs=5)
        orders |= {(seed, epoch): tuple(order) for epoch, order in enumerate(epochs)}
    assert orders[0, 1] != orders[1, 0] and orders[3, 2] != orders[4, 1]
    assert len(set(orders.values())) == len(orders) == 25


def loader(sampler: ResumableShuffle) -> ResumableLoader:
    return ResumableLoader(range(sampler.size), sampler.batch_size, sampler=sampler)


def test_a_resumed_loader_continues_the_order_its_state_records():
    straight = loader(ResumableShuffle(103, batch_size=4, seed=7))
    state = straight.state_dict()
    assert state == {"seed": 7, "batches_per_epoch": 25, "draw": SEED_STREAM}
    resumed = loader(ResumableShuffle(103, batch_size=4, seed=7, start_batch=5, start_epoch=1))
    resumed.load_state_dict(state)  # as Lightning does, before the first batch
    assert batches(resumed.sampler, 2) == batches(straight.sampler, 3)[25 + 5 :]
    assert resumed.state_dict() == state


def test_a_checkpoint_without_the_draw_record_resumes_on_its_seed_plus_epoch_orders():
    # What the loader saved until the draw was recorded: its orders came from seed + epoch.
    old_state = {"seed": 7, "batches_per_epoch": 25}
    old_orders = [
        torch.randperm(103, generator=torch.Generator().manual_seed(7 + e)) for e in (1, 2)
    ]
    old_batches = [b for order in old_orders for b in batches_of(order[:100].tolist(), 4)]
    resumed = loader(ResumableShuffle(103, batch_size=4, seed=7, start_batch=5, start_epoch=1))
    resumed.load_state_dict(old_state)
    assert batches(resumed.sampler, 2) == old_batches[5:]
    # Its next checkpoints record that draw; a new run of that seed draws other orders.
    assert resumed.state_dict() == old_state | {"draw": SEED_PLUS_EPOCH}
    new_run = ResumableShuffle(103, batch_size=4, seed=7, start_batch=5, start_epoch=1)
    assert batches(new_run, 2) != old_batches[5:]


def test_a_checkpoint_of_another_seed_or_an_unknown_draw_is_refused():
    state = loader(ResumableShuffle(103, batch_size=4, seed=7)).state_dict()
    with pytest.raises(ValueError, match="resume with the seed, data and data.batch_size"):
        loader(ResumableShuffle(103, batch_size=4, seed=8)).load_state_dict(state)
    with pytest.raises(ValueError, match="drawn in a way this code does not know .draw=3."):
        loader(ResumableShuffle(103, batch_size=4, seed=7)).load_state_dict(state | {"draw": 3})


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
