"""The checkpointer's own collectives, on a gloo group of their own.

Checkpoint traffic never shares a group with training: collectives issued from the persist
thread on the training group hang, because they interleave with the training loop's own. A
single process without ``torch.distributed`` gets the same API with trivial answers, so the
rest of embckpt never branches on it.
"""

from __future__ import annotations

import atexit
import gc
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from embckpt.errors import EmbckptError, RankError

_T = TypeVar("_T")

# Objects a checkpointer leaves in reference cycles (with the gloo work and tensors they hold)
# are otherwise freed by the interpreter's last collection, during finalization: a gloo worker
# thread that then needs the GIL to free a tensor is cancelled, and the process aborts
# ("terminate called without an active exception"; 1 run in 3 of the torchrun job in
# tests/test_torchrun.py after a restore, 0 in 12 with this). Collecting at exit frees them
# while the interpreter still runs. The cycle's source was not found.
atexit.register(gc.collect)


class Collective:
    """Rank, world size and object collectives for checkpoint coordination."""

    def __init__(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            # Every rank is a member (no ``ranks``), so never torch 2.14's declared non-member.
            group = cast(dist.ProcessGroup, dist.new_group(backend="gloo"))
            self.group: dist.ProcessGroup | None = group
        else:
            self.rank, self.world_size, self.group = 0, 1, None

    def close(self) -> None:
        """Destroys the group: gloo keeps threads and sockets per group until then, so a
        process building checkpointers one after another would collect them."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None

    def all_gather(self, obj: _T) -> list[_T]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with _failing_as_rank_error("all_gather"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        if self.group is None:
            return obj
        box = [obj]
        with _failing_as_rank_error("broadcast"):
            dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def broadcast_numbers(self, values: list[float], src: int = 0) -> list[float]:
        """Rank ``src``'s ``values`` on every rank (float64: integers exact up to 2**53), in one
        tensor broadcast: :meth:`broadcast` pickles and sends a size, then the bytes, which
        cost 0.54 ms against 0.16 ms by median (2 gloo ranks, the 2-core machine of
        ``benchmarks/results/``)."""
        if self.group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        with _failing_as_rank_error("broadcast"):
            dist.broadcast(tensor, src=src, group=self.group)
        return tensor.tolist()

    def all_sum(self, values: list[float]) -> list[float]:
        if self.group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        with _failing_as_rank_error("all_reduce"):
            dist.all_reduce(tensor, group=self.group)
        return tensor.tolist()

    def gather_checked(
        self,
        value: _T,
        error: BaseException | None,
        what: str,
        peer_error: type[RankError] = RankError,
    ) -> list[_T]:
        """Every rank's ``value``, in one collective with the agreement of :meth:`check`:
        raises on every rank if any rank passes an ``error``."""
        try:
            gathered = self.all_gather((value, None if error is None else _describe(error)))
        except Exception as exc:  # the group itself failed: no rank can agree any more
            raise peer_error(f"{what}: ranks could not agree: {exc}") from error or exc
        failed = [(rank, msg) for rank, (_, msg) in enumerate(gathered) if msg is not None]
        if failed:
            if error is not None:
                raise error
            detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed)
            raise peer_error(f"{what} failed on {len(failed)} rank(s): {detail}")
        return [v for v, _ in gathered]

    def check(
        self, error: BaseException | None, what: str, peer_error: type[RankError] = RankError
    ) -> None:
        """Raises on every rank if any rank failed ``what``.

        The failing rank re-raises its own error (it names the file or table); the others raise
        ``peer_error`` (a :class:`RankError`; ``SaveRankError`` during a save) quoting every
        failure. A collective that fails itself (a peer died, the group's timeout passed)
        raises ``peer_error`` too, so a caller sees one kind of error whatever went wrong.

        The ranks first sum a flag (one all-reduce of one number), and gather the reasons only
        when a rank failed: gathering them every time cost three times the all-reduce (on the
        2-core machine of ``benchmarks/results/``, 2 gloo ranks: 0.87 ms against 0.25 ms by
        median), and a restore agrees twice (three times onto another world size).
        """
        if self.group is None:
            self.gather_checked(None, error, what, peer_error)
            return
        try:
            (failed,) = self.all_sum([0.0 if error is None else 1.0])
        except Exception as exc:  # the group itself failed: no rank can agree any more
            raise peer_error(f"{what}: ranks could not agree: {exc}") from error or exc
        if failed:  # every rank sees it: they gather the reasons together
            self.gather_checked(None, error, what, peer_error)


@contextmanager
def _failing_as_rank_error(what: str) -> Iterator[None]:
    """A collective that fails (a peer died, the group's timeout passed) raises
    :class:`RankError`, so callers see an embckpt error whatever went wrong."""
    try:
        yield
    except RankError:
        raise
    except RuntimeError as exc:
        raise RankError(f"checkpoint {what} across ranks failed: {exc}") from exc


def _describe(error: BaseException) -> str:
    if isinstance(error, EmbckptError):
        return f"{type(error).__name__}: {error}"
    return "".join(traceback.format_exception_only(type(error), error)).strip()
