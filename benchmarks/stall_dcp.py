"""Our saves and restores against DCP's on one model: the ``dcp`` phase of ``benchmarks/stall.py``.

Each round, interleaved on the same live model:

- the headline chain (adaptive 4-bit: a full and 5 incremental diffs, 10 training steps apart)
  restored with the defaults; where the tables are on a GPU its quantized rows cross as codes
  and decode there (``codecs/device_decode.py``);
- our full lossless save (waited) and its restore (raw rows from page-locked memory);
- ``dcp.save`` / ``dcp.load`` of the model's state dict, then ``dcp.async_save``.

On a GPU, in the first round, the headline chain is restored a second time with the device
decode turned off (the CPU decodes, floats cross): ``headline_chain_device_decode_exact`` says
whether every table and row state is the same bit for bit, and
``headline_chain_cpu_decode_restore_s`` what that restore took. Each restore's busy seconds
per phase (``RESTORE_PHASES``) are kept.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def cpu_decode() -> Iterator[None]:
    """Quantized rows decode on the CPU while inside (the device path reads as failed)."""
    from embckpt.codecs import device_decode

    device_decode._failed.append("turned off by stall_dcp.py for a comparison")
    try:
        yield
    finally:
        device_decode._failed.pop()


def live_state(train: Any) -> list[torch.Tensor]:
    """Every table's weights and row states, copied to the host."""
    from embckpt.sharding import discover

    train.sync()
    shards = discover(train.model).shards
    return [t.detach().cpu() for s in shards for t in (s.weight, *s.row_states.values())]


def timed_load(train: Any, ckpt: Any) -> tuple[float, dict[str, float]]:
    """Seconds of ``ckpt.load()`` until the device is done, and its phases."""
    train.sync()
    started = time.perf_counter()
    result = ckpt.load()
    train.sync()
    return time.perf_counter() - started, {"links": len(result.chain), **result.phases}


def against_dcp(train: Any, root: Path, args: Any) -> dict[str, Any]:
    """Our saves and restores against dcp.save / dcp.load, interleaved (module doc)."""
    import torch.distributed.checkpoint as dcp

    from embckpt import CheckpointConfig, Checkpointer

    out: dict[str, Any] = {}
    ours_save, ours_restore, dcp_save, dcp_load, dcp_async = [], [], [], [], []
    chain_restore, chain_phases, full_phases = [], [], []
    config = CheckpointConfig(policy="full", pipeline="off")
    headline = CheckpointConfig(policy="incremental", full_every=0, codec="adaptive", bits=4)
    for r in range(args.rounds):
        folder = root / f"chain{r}"
        with Checkpointer(train.model, str(folder), optimizer=train.opt, config=headline) as ckpt:
            for link in range(6):
                for _ in range(10):
                    train.step()
                ckpt.save(link + 1).wait()
            seconds, phases = timed_load(train, ckpt)
            chain_restore.append(seconds)
            chain_phases.append(phases)
            if r == 0 and train.device.type == "cuda":
                on_device = live_state(train)
                with cpu_decode():
                    seconds, phases = timed_load(train, ckpt)
                out["headline_chain_cpu_decode_restore_s"] = seconds
                out["headline_chain_cpu_decode_phases"] = phases
                out["headline_chain_device_decode_exact"] = all(
                    torch.equal(a.view(torch.int32), b.view(torch.int32))
                    for a, b in zip(on_device, live_state(train), strict=True)
                )
                del on_device
        shutil.rmtree(folder, ignore_errors=True)
        folder = root / f"ours{r}"
        train.step()
        train.sync()
        with Checkpointer(train.model, str(folder), optimizer=train.opt, config=config) as ckpt:
            started = time.perf_counter()
            ckpt.save(1).wait()
            ours_save.append(time.perf_counter() - started)
            seconds, phases = timed_load(train, ckpt)
            ours_restore.append(seconds)
            full_phases.append(phases)
        shutil.rmtree(folder, ignore_errors=True)
        state = {"model": train.model.state_dict()}
        folder = root / f"dcp{r}"
        started = time.perf_counter()
        dcp.save(state, checkpoint_id=str(folder))
        dcp_save.append(time.perf_counter() - started)
        train.sync()
        started = time.perf_counter()
        dcp.load(state, checkpoint_id=str(folder))
        train.sync()
        dcp_load.append(time.perf_counter() - started)
        shutil.rmtree(folder, ignore_errors=True)
        try:  # its staging of TorchRec's ShardedTensors fails on some releases
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(root / f"async{r}"))
            dcp_async.append(time.perf_counter() - started)
            future.result()
        except Exception as exc:
            out["dcp_async_save_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        shutil.rmtree(root / f"async{r}", ignore_errors=True)
    out.update(
        ours_save_s=ours_save,
        ours_restore_s=ours_restore,
        ours_restore_phases=full_phases,
        dcp_save_s=dcp_save,
        dcp_load_s=dcp_load,
        dcp_async_save_block_s=min(dcp_async) if dcp_async else None,
        save_vs_dcp=min(ours_save) / min(dcp_save),
        restore_vs_dcp=min(ours_restore) / min(dcp_load),
        headline_chain_restore_s=chain_restore,
        headline_chain_restore_phases=chain_phases,
        restore_vs_dcp_raw_full=min(ours_restore) / min(dcp_load),
        restore_vs_dcp_headline_chain=min(chain_restore) / min(dcp_load),
    )
    return out
