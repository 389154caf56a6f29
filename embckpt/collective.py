"""The checkpointer's own collectives, on a gloo group of their own.

Checkpoint traffic never shares a group with training: collectives issued from the persist
thread on the training group hang, because they interleave with the training loop's own. A
single process without ``torch.distributed`` gets the same API with trivial answers, so the
rest of embckpt never branches on it.
"""

from __future__ import annotations

import traceback
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from embckpt.errors import EmbckptError, RankError

_T = TypeVar("_T")


class Collective:
    """Rank, world size and object collectives for checkpoint coordination."""

    def __init__(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            self.group: dist.ProcessGroup | None = dist.new_group(backend="gloo")
        else:
            self.rank, self.world_size, self.group = 0, 1, None

    def all_gather(self, obj: _T) -> list[_T]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_sum(self, values: list[float]) -> list[float]:
        if self.group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, group=self.group)
        return tensor.tolist()

    def all_max(self, values: list[float]) -> list[float]:
        if self.group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def check(self, error: BaseException | None, what: str) -> None:
        """Raises on every rank if any rank failed ``what``.

        The failing rank re-raises its own error (it names the file or table); the others raise
        a :class:`RankError` quoting every failure.
        """
        reports = self.all_gather(None if error is None else _describe(error))
        failed = [(rank, msg) for rank, msg in enumerate(reports) if msg is not None]
        if not failed:
            return
        if error is not None:
            raise error
        detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed)
        raise RankError(f"{what} failed on {len(failed)} rank(s): {detail}")


def _describe(error: BaseException) -> str:
    if isinstance(error, EmbckptError):
        return f"{type(error).__name__}: {error}"
    return "".join(traceback.format_exception_only(type(error), error)).strip()
