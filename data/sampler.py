"""The order in which a training run visits examples, as a pure function of (seed, step), so a
resumed run continues with exactly the batches the interrupted one would have trained on; and
the fixed order in which evaluation scores them."""

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

# Evaluation's order does not depend on the run's seed: runs with different seeds, cut short
# alike, score the same examples.
EVALUATION_SEED = 0

# How a run draws its epochs' permutations. A checkpoint records it with the run's place in the
# order (ResumableLoader), so that a run resumes on the orders it started with.
#
# SEED_PLUS_EPOCH, in checkpoints written until 2026-11-27 (they have no record): epoch e's
# permutation came from a generator seeded with seed + e. Seed s at epoch 1 then trained on the
# order of seed s + 1 at epoch 0, and so on: the runs of a seed sweep (seed=0,1,2...) trained on
# shifted copies of one another's orders, correlating runs meant to be independent.
#
# SEED_STREAM: the epochs' permutations one after another from one generator seeded with the
# seed alone, as a shuffling DataLoader draws them; distinct seeds are distinct streams. Seeding
# a generator per epoch from both numbers cannot be made collision-free: torch's CPU generator
# keeps only the low 32 bits of its seed, which the config's seeds, [0, 2**32), fill on their
# own (seed * 2**32 + epoch would give every seed the same orders).
SEED_PLUS_EPOCH, SEED_STREAM = 1, 2

# Indices handed to Python per conversion. An epoch of the default data is 4.3 million of
# them: made into Python ints all at once, they took 0.15 s before the first step could start.
INDICES_PER_CHUNK = 16384


def evaluation_order(size: int) -> list[int]:
    """The one fixed shuffled order in which evaluation visits `size` examples (see RankShard):
    any first part of it is a sample of all of them."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(EVALUATION_SEED)).tolist()


def batches_per_epoch(size: int, batch_size: int, world_size: int) -> int:
    """The full batches of `batch_size` that `size` training examples give each of `world_size`
    processes in an epoch; none is a one-line error."""
    batches = size // world_size // batch_size
    if batches == 0:
        raise ValueError(
            f"{size} training examples make no full batch of data.batch_size={batch_size} "
            f"on each of {world_size} process(es): lower data.batch_size or add data"
        )
    return batches


class ResumableShuffle(Sampler[int]):
    """A fresh permutation of the dataset every epoch, the next one of the seed's random stream
    (see SEED_STREAM), split among the ranks of a distributed run, and started at any batch.

    Each rank takes every world_size-th index of the permutation, cut to the same length on every
    rank, so ranks see disjoint examples and equally many batches. The first epoch to be iterated
    is the one holding batch `start_batch` of epoch `start_epoch` (this rank's batches; past the
    end of that epoch, they count on into the next ones), and starts there; later epochs start
    at their first batch. A run resumed in epoch e draws the e permutations before it again to
    reach its own: as many indices as it has trained on examples, which is quick beside training
    on them.

    `draw` is SEED_STREAM for a new run; a resumed one takes its checkpoint's (ResumableLoader).
    """

    def __init__(
        self,
        size: int,
        batch_size: int,
        seed: int,
        start_batch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start_epoch: int = 0,
    ) -> None:
        self.per_rank = size // world_size
        self.batches_per_epoch = batches_per_epoch(size, batch_size, world_size)
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.rank, self.world_size = rank, world_size
        batches_before = start_epoch * self.batches_per_epoch + start_batch
        self.epoch, self.skip = divmod(batches_before, self.batches_per_epoch)
        self.draw = SEED_STREAM
        self._stream: torch.Generator | None = None  # drawn up to self.epoch, once iterated

    def __len__(self) -> int:
        # A whole epoch even when resuming into one: Lightning counts the batches already done in
        # the restored epoch against this length, and the sampler yields only the rest.
        return self.batches_per_epoch * self.batch_size

    def state(self) -> dict:
        return {"seed": self.seed, "batches_per_epoch": self.batches_per_epoch, "draw": self.draw}

    def __iter__(self) -> Iterator[int]:
        order = self._epoch_permutation()
        mine = order[self.rank :: self.world_size][: self.batches_per_epoch * self.batch_size]
        start = self.skip * self.batch_size
        self.epoch, self.skip = self.epoch + 1, 0
        return (i for chunk in mine[start:].split(INDICES_PER_CHUNK) for i in chunk.tolist())

    def _epoch_permutation(self) -> torch.Tensor:
        if self.draw == SEED_PLUS_EPOCH:
            return self._permutation(torch.Generator().manual_seed(self.seed + self.epoch))
        if self._stream is None:  # the first epoch iterated, which a resumed run's may not be
            self._stream = torch.Generator().manual_seed(self.seed)
            for _ in range(self.epoch):  # the epochs before it, drawn again to reach its own
                self._permutation(self._stream)
        return self._permutation(self._stream)

    def _permutation(self, generator: torch.Generator) -> torch.Tensor:
        # int32 where it holds the indices: the same permutation (the same draws), in half the
        # memory and time (0.05 s against 0.08 s for the default data's 4.3M blocks, in a run)
        dtype = torch.int32 if self.size < 2**31 else torch.int64
        return torch.randperm(self.size, generator=generator, dtype=dtype)


class RankShard(Sampler[int]):
    """Evaluation order: every example once, in one fixed shuffled order (the same in every run),
    each rank taking every world_size-th; ranks score disjoint examples and, unlike
    DistributedSampler, none is repeated to even out the shards.

    Shuffled, because an evaluation cut short (trainer.limit_val_batches) scores the first
    batches only: in the text's order those would be its beginning (the first plays, the first
    documents), a biased estimate of the whole; shuffled, they are a sample of all of it.
    """

    def __init__(self, size: int, rank: int = 0, world_size: int = 1) -> None:
        self.indices = evaluation_order(size)[rank::world_size]

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


class ResumableLoader(DataLoader):
    """A DataLoader over a ResumableShuffle. Its position is the data module's to save (it counts
    the batches trained on, which a loader that fetches ahead cannot); what the loader saves, in
    Lightning's checkpoint, is what that position means (the seed, the epoch length and how the
    orders are drawn), so that a resume over other data or with another seed fails instead of
    silently training on other batches, and a resumed run draws its orders as it started to.
    Lightning loads the state before the loader's first batch. Being stateful also tells
    Lightning that resuming mid-epoch is exact."""

    def state_dict(self) -> dict:
        return self.sampler.state()

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        state = {"draw": SEED_PLUS_EPOCH} | state  # written before the draw was recorded
        if state["draw"] not in (SEED_PLUS_EPOCH, SEED_STREAM):
            raise ValueError(
                "the checkpoint's data order is drawn in a way this code does not know "
                f"(draw={state['draw']}): resume it with the code that wrote it"
            )
        self.sampler.draw = state["draw"]
        if state != self.sampler.state():
            raise ValueError(
                f"the checkpoint's data order {state} differs from this run's "
                f"{self.sampler.state()}: resume with the seed, data and data.batch_size of the "
                "checkpoint's run"
            )
