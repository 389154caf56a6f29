"""The training side of a copy-on-write snapshot: its window opened, rows copied just before
their update.

FBGEMM's fused kernels update, in their backward, exactly the rows their forward looked up.
A forward hook on each tracked kernel attaches a gradient hook to its output, carrying the
bits the tracker computed for that lookup; gradient hooks run before the kernel's backward
consumes the gradient, so while a save's copy-on-write window is open the hook copies those
rows first (``CowSession.protect``). The hook is attached on every step, not only during a
window: a lookup made before ``save()`` whose backward runs after it (pipelines that run a
batch's embedding forward ahead) is protected too. Outside a window it costs a hook call.
"""

from __future__ import annotations

from typing import Any

import torch

from embckpt.blocks import TableShard
from embckpt.codecs import Codec, DeltaCodec
from embckpt.codecs.uniform import UniformCodec
from embckpt.save.cow import CowBlock, CowSession, Encoder
from embckpt.save.slabs import SlabPool
from embckpt.sharding import ShardedModel
from embckpt.tracking import RowTracker


class ProtectHooks:
    """Hooks every kernel the tracker watches; ``session`` is the open window, or None."""

    def __init__(self, tracker: RowTracker) -> None:
        self.session: CowSession | None = None
        self._hooks = [
            module.register_forward_hook(
                lambda _m, _args, output, n=number, t=tracked: self._attach(n, t, output)
            )
            for number, (module, tracked) in enumerate(tracker.lookups())
        ]

    def _attach(self, number: int, tracked: Any, output: Any) -> None:
        bits = tracked.last
        tracked.last = None
        if bits is None or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return

        def before_update(grad: torch.Tensor) -> None:
            session = self.session
            if session is not None:
                session.protect(number, bits)

        output.register_hook(before_update)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def cow_supported(sharded: ShardedModel) -> bool:
    """Whether every row update of the model follows a lookup (or is a data-parallel table's,
    copied while ``save()`` runs): not with kernels whose forward rewrites every row (EMA in
    place) nor with managed-collision modules, whose evictions re-initialise rows without a
    lookup; those keep the snapshot that holds updates back until the copy is done."""
    return not sharded.every_row_blocks() and not sharded.mch


def open_window(
    tracker: RowTracker,
    selected: list[tuple[TableShard, torch.Tensor | None]],
    pool: SlabPool,
    hooks: ProtectHooks,
    max_rows: int,
    encoder: Encoder | None,
) -> CowSession:
    """Starts a save's copy-on-write window over ``selected`` (block, rows to write; None:
    all): data-parallel blocks are copied now, the rest by the copier or by the steps."""
    bits = tracker.module_bits()
    blocks: list[list[CowBlock]] = [[] for _ in bits]
    for shard, rows in selected:
        module, first = tracker.layout(shard.key)
        blocks[module].append(CowBlock(shard, first, rows))
    device = selected[0][0].weight.device if selected else torch.device("cpu")
    eager = frozenset(s.key for s, _ in selected if s.sharding_type == "data_parallel")
    session = CowSession(
        list(zip(bits, blocks, strict=True)), pool, device, max_rows, encoder, eager
    )
    session.copy_eager()
    hooks.session = session
    return session


def device_encoder(codec: Codec, full: bool, device: torch.device) -> Encoder | None:
    """Quantization on the device before the copy (Check-N-Run), where the save writes whole
    rows through a uniform codec on a CUDA model: the codec itself, or for a full the whole-row
    codec of ``delta`` diffs. The copies and host slabs then carry codes, not fp32 rows."""
    if device.type != "cuda":
        return None
    whole: Codec | None = codec
    if codec.additive:
        whole = codec.whole if full and isinstance(codec, DeltaCodec) else None
    if not isinstance(whole, UniformCodec):  # raw, fp16, k-means...: nothing to import
        return None
    # Triton, imported where a GPU model saves through a uniform codec (about 0.1 s the first
    # time: the saver calls this once when it is built, so that no save() pays it).
    from embckpt.codecs import device_encode

    if not device_encode.is_available(device):
        return None
    chosen = whole
    return lambda rows: device_encode.device_fused(chosen, rows)
