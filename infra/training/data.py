"""A data loader whose position is part of the checkpoint, and the loaders a training session takes.

The order of samples is a pure function of (seed, epoch): a permutation of the
dataset. The position is the number of samples of that global order already
handed to the training loop, so a resume continues at the next batch, mid-epoch,
and the position means the same thing whatever the data-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from rewind.infra.errors import ConfigError


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


class ResumableLoader:
    """Yields batches forever (epoch after epoch) and remembers how far it got.

    ``rank``/``world`` split each global batch of ``batch_size * world`` samples
    between data-parallel ranks.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        world: int = 1,
        num_workers: int = 0,
    ) -> None:
        if batch_size < 1 or world < 1 or not 0 <= rank < world:
            raise ConfigError(f"bad loader shape: batch_size={batch_size} rank={rank} world={world}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world = world
        self.num_workers = num_workers
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's global order already handed out
        self.total = 0  # samples handed out since the start, every epoch: the position Rewind talks about
        self.last_indices: list[int] = []  # dataset indices of the batch most recently handed out

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ConfigError(f"checkpoint data order has seed {state['seed']}, this loader {self.seed}")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.total = int(state.get("total", self.consumed))  # checkpoints before "total": epoch 0 only

    @property
    def position(self) -> int:
        """Samples handed out since the start, across epochs (the same on every rank)."""
        return self.total

    def _left_in_epoch(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        return (n - self.consumed) // self.global_batch * self.global_batch

    def skip_to(self, position: int) -> None:
        """Step over a data window: the next batch starts at global ``position``, epochs included."""
        if position < self.total:
            raise ConfigError(f"cannot skip back from {self.total} to {position}")
        while self.total < position:
            step = min(position - self.total, self._left_in_epoch())
            if step == 0 and self.consumed == 0:
                raise ConfigError("dataset is smaller than one global batch")
            self.consumed, self.total = self.consumed + step, self.total + step
            if self.total < position or self._left_in_epoch() == 0:
                self.epoch, self.consumed = self.epoch + 1, 0

    def _rank_indices(self) -> list[int]:
        order = epoch_order(len(self.dataset), self.seed, self.epoch)  # type: ignore[arg-type]
        rest = order[self.consumed :]
        usable = (len(rest) // self.global_batch) * self.global_batch  # drop the ragged tail
        return rest[:usable].view(-1, self.world, self.batch_size)[:, self.rank, :].reshape(-1).tolist()

    def __iter__(self) -> Iterator[Any]:
        while True:
            indices = self._rank_indices()
            if not indices:
                if self.consumed == 0:
                    raise ConfigError("dataset is smaller than one global batch")
                self.epoch, self.consumed = self.epoch + 1, 0
                continue
            # A private generator: starting a DataLoader iterator otherwise draws a
            # worker seed from the global RNG, and a resumed run would see shifted
            # dropout masks from then on.
            loader = DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                sampler=indices,
                num_workers=self.num_workers,
                drop_last=True,
                generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch),
            )
            for i, batch in enumerate(loader):
                self.last_indices = indices[i * self.batch_size : (i + 1) * self.batch_size]
                self.consumed += self.global_batch
                self.total += self.global_batch
                yield batch
            self.epoch, self.consumed = self.epoch + 1, 0


class SkippableLoader(Protocol):
    """A loader whose position (samples of the global order consumed) can be moved forward."""

    @property
    def position(self) -> int: ...

    def skip_to(self, position: int) -> None: ...


class StatefulLoader(Protocol):
    """Any loader that can say where it is and go back there (torchdata's ``StatefulDataLoader``): its
    state is checkpointed and restored exactly; under torchrun it is each rank's own, restored on as many
    ranks only. It has no global position, so it can neither skip a data window nor be resharded."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
