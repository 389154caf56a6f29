"""Files sent between ranks over the checkpointer's gloo group: a peer's replica at save time,
and files a rank's node does not hold at restore time. Never through shared storage.

Every rank calls :func:`exchange` together: one gather says who sends how many bytes to whom,
then each pair moves one buffer with ``isend``/``irecv``.
"""

from __future__ import annotations

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
    buffers: dict[int, torch.Tensor] = {}
    try:
        for src, plan in enumerate(plans):
            sized = plan.get(comm.rank)
            if not sized or src == comm.rank:
                continue
            buffers[src] = torch.empty(sum(n for _, n in sized), dtype=torch.uint8)
            if buffers[src].numel():
                works.append(dist.irecv(buffers[src], src=src, group=comm.group))
        for dst, files in outgoing.items():
            if dst == comm.rank or not files:
                continue
            blob = bytearray(b"".join(memoryview(data) for _, data in files))
            if blob:
                works.append(dist.isend(torch.frombuffer(blob, dtype=torch.uint8), dst, comm.group))
        for work in works:
            if work is not None:
                work.wait()
    except RuntimeError as exc:
        raise RankError(f"sending checkpoint files between ranks failed: {exc}") from exc
    for src, tensor in buffers.items():
        data = tensor.numpy()
        cuts = np.cumsum([0] + [n for _, n in plans[src][comm.rank]])
        received[src] = [
            (key, pa.py_buffer(data[cuts[i] : cuts[i + 1]]))
            for i, (key, _) in enumerate(plans[src][comm.rank])
        ]
    if comm.rank in outgoing:
        received[comm.rank] = [(key, pa.py_buffer(data)) for key, data in outgoing[comm.rank]]
    return received
