"""Who writes a save's rows, chosen and made ready when the ``Checkpointer`` is built.

``CheckpointConfig.writer`` picks the rank's writer process (``save/writer_process.py``) or
the writer's threads in the training process; either way every kernel a save runs is ready
before the first ``save()``, so that no step of a save's window waits for a compilation: the
numba kernels of the codecs (loaded from numba's disk cache, or compiled, by encoding a few
rows of each block layout: in the writer process, or here for threads) and, on a GPU, the
Triton kernels of the device encoder, compiled for each column count the model has.
"""

from __future__ import annotations

import logging
import time

import torch

from embckpt.blocks import TableShard
from embckpt.codecs import Codec, device_decode
from embckpt.config import CheckpointConfig
from embckpt.save.protect import device_encoder
from embckpt.save.slabs import SlabPool
from embckpt.save.writer import RowFileWriter
from embckpt.save.writer_process import WriterProcess
from embckpt.save.writer_worker import WriterSpec
from embckpt.storage.fs import CheckpointStore

log = logging.getLogger(__name__)


def uses_process(config: CheckpointConfig, device: torch.device) -> bool:
    """Whether copy-on-write saves go to a writer process (``writer``: ``auto`` picks it for
    models on a GPU)."""
    if config.writer == "auto":
        return device.type == "cuda"
    return config.writer == "process"


def start_writer_process(
    store: CheckpointStore,
    writer: RowFileWriter,
    codec: Codec,
    shards: list[TableShard],
    slabs: SlabPool,
) -> WriterProcess:
    """The rank's writer process, writing what ``writer`` would, into ``store``."""
    assert slabs.memory is not None, "the slabs must be shared with the process"
    spec = WriterSpec(
        store=store,
        state_codec=dict(writer.state_codec.get_config()),
        base_codec=dict(writer.base_codec.get_config()),
        codec=dict(codec.get_config()),
        rank=writer.rank,
        row_group_rows=writer.row_group_rows,
        threads=writer.threads,
        pack_below_bytes=writer.pack_below_bytes,
        memory_bytes=slabs.memory.nbytes,
        shards={s.key: s.on_meta() for s in shards},
    )
    return WriterProcess(spec, slabs.memory)


def warm_kernels(
    writer: RowFileWriter | None, codec: Codec, shards: list[TableShard], cow: bool
) -> None:
    """Readies the kernels a save runs in this process: the codec's CPU kernels when
    ``writer`` (the thread writer) encodes here, the device encoder's on a GPU model, and
    there the device decoder a restore of the codec's rows runs."""
    started = time.perf_counter()
    if writer is not None:
        writer.warm(codec, shards)
    device = shards[0].weight.device if shards else torch.device("cpu")
    if cow and device.type == "cuda":
        generator = torch.Generator(device).manual_seed(0)  # the job's own RNG is left alone
        for full in (True, False):
            encoder = device_encoder(codec, full, device)
            if encoder is None:
                continue
            for cols in sorted({s.num_cols for s in shards if s.weight.dtype == torch.float32}):
                encoder(torch.randn(8, cols, device=device, generator=generator) * 0.05)
        torch.cuda.synchronize(device)
    if device.type == "cuda":
        device_decode.warm(codec, [s.num_cols for s in shards], device)
    log.debug("save kernels ready in %.2f s", time.perf_counter() - started)
