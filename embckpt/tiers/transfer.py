"""Files sent between ranks over the checkpointer's gloo group: a peer's replica at save time,
and files a rank's node does not hold at restore time. Never through shared storage.

Every rank calls :func:`exchange` together: one gather says who sends how many bytes to whom,
then each file moves as its own message (``isend``/``irecv``, matched in order between a
pair), sent from the bytes as read and received into a buffer of its own: no copy joins or cuts
them. Measured on the 2-core machine of ``benchmarks/results/`` (gloo on loopback, two
processes): 100 MB in 8 files took 0.25 s joined into one buffer first, 0.07 s file by file.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from embckpt.collective import Collective
from embckpt.errors import RankError

Item = tuple[Hashable, pa.Buffer | bytes]


def exchange(
    comm: Collective, outgoing: Mapping[int, Sequence[Item]]
) -> dict[int, list[tuple[Hashable, pa.Buffer]]]:
    """Sends ``outgoing[dst]`` (keys and bytes) to each rank ``dst`` (collective).

    Returns:
        What each source rank sent this rank, in its order.

    Raises:
        RankError: the group failed (a peer died, the timeout passed).
    """
    sizes = {
        dst: [(key, len(memoryview(data))) for key, data in items]
        for dst, items in outgoing.items()
    }
    plans = comm.all_gather(sizes)
    received: dict[int, list[tuple[Hashable, pa.Buffer]]] = {}
    works = []
    try:
        for src, plan in enumerate(plans):
            sized = plan.get(comm.rank)
            if not sized or src == comm.rank:
                continue
            buffers = [torch.empty(n, dtype=torch.uint8) for _, n in sized]
            for buffer in buffers:
                if buffer.numel():
                    works.append(dist.irecv(buffer, src=src, group=comm.group))
            received[src] = [
                (key, pa.py_buffer(buffer.numpy()))
                for (key, _), buffer in zip(sized, buffers, strict=True)
            ]
        for dst, files in outgoing.items():
            if dst == comm.rank:
                continue
            for _, data in files:
                if len(memoryview(data)):
                    works.append(dist.isend(_send_view(data), dst, comm.group))
        for work in works:
            if work is not None:
                work.wait()
    except RuntimeError as exc:
        raise RankError(f"sending checkpoint files between ranks failed: {exc}") from exc
    if comm.rank in outgoing:
        received[comm.rank] = [(key, pa.py_buffer(data)) for key, data in outgoing[comm.rank]]
    return received


def _send_view(data: pa.Buffer | bytes) -> torch.Tensor:
    """A uint8 tensor over ``data``'s bytes, not a copy. Torch warns that the memory is
    read-only; sending only reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
