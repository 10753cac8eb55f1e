"""The executor an engine steps: the ranks it runs on (DESIGN §8: parallel ranks live behind one executor below the
engine). `Executor` is all an engine asks of them; `SingleDevice` is the executor of one device, where nothing is
sent; `deltaspec.engine.workers` holds those of several ranks, tensor-parallel and pipeline stages (rank 0's, which
starts and drives the followers, and a follower's). `deltaspec.engine.setup.engine_executor` picks one from the
resolved config."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol, TypeVar

from deltaspec.parallel.group import SINGLE, TensorParallel
from deltaspec.parallel.pipeline import WHOLE, Pipeline

T = TypeVar("T")


class Executor(Protocol):
    """The ranks an engine runs on. Every rank runs the same engine over its shard of the model, in lock step; rank 0
    alone talks to the outside."""

    tp: TensorParallel  # this rank's place in its stage's group, by which its model is sharded
    pipeline: Pipeline  # this rank's pipeline stage: which layers it holds, whom it trades activations with

    def building(self) -> AbstractContextManager[None]:
        """Around building this rank's engine: if that fails, stop the other ranks and leave the group."""
        ...

    def share(self, value: T) -> T:
        """Rank 0's `value` on every rank (the other ranks pass None)."""
        ...

    def record(self, *change) -> None:
        """Rank 0: a change made from outside the engine's steps (admit, abort, fail), for the other ranks to apply
        before the next step."""
        ...

    def step(self, running) -> None:
        """Before a step: every rank takes it (rank 0 sends the changes recorded since the last one and what its
        `running` sequences are)."""
        ...

    def close(self) -> None:
        """Stop the other ranks and leave the group."""
        ...


class SingleDevice:
    """The executor of an engine on one device: nothing to send, record or close."""

    tp = SINGLE
    pipeline = WHOLE

    @contextmanager
    def building(self) -> Iterator[None]:
        yield

    def share(self, value: T) -> T:
        return value

    def record(self, *change) -> None:
        pass

    def step(self, running) -> None:
        pass

    def close(self) -> None:
        pass
