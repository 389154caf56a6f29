"""Restore times as a relaunched job sees them: each load the first of a fresh pair of ranks.

Why: a job restores after a failure in new processes, whose heap has none of the pages a load's
buffers need. Timed again and again in one process, a load reuses the pages the one before it
freed, or not, as the C heap's state left by the load before it allows: on ``family.py``'s
long_interval model (2 gloo ranks, the 2-core machine of ``results/``), ``dcp.load`` took 25-27
ms best repeated alone, 33-42 ms right after a restore of ours (which ends by trimming the
heap), 47-51 ms with glibc's mmap threshold held at its initial 128 KiB, and 54-58 ms as the
first load of fresh ranks; our restore of the same model's newest chain took 80-97 ms repeated
and 97, 117 and 205 ms as the first load (three launches). Our restores decode into the model's
own rows, which building the model faulted in already; ``dcp.load`` reads into buffers of its
own first.

Each round launches, for each checkpoint directory and for ``dcp.load``, in turn (the order
turning round by round), a fresh pair of ranks (the launcher's fork server: imports done, as in
a training script) that builds the model, opens the ``Checkpointer`` (ours) and times one load
between barriers; a time is the slowest rank's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import build_workload, dcp_state, timed_load

from embckpt.config import CheckpointConfig
from embckpt.examples.launcher import run_ranks
from embckpt.examples.workload import DemoConfig

DCP = "dcp_load"


def _load_once(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    directory: str,
    config: CheckpointConfig | None,
    step: int | None,
) -> float:
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    if config is None:
        return timed_load(
            lambda: dcp.load(dcp_state(work.model, work.optimizer), checkpoint_id=directory)
        )
    restored: list[Any] = []
    with Checkpointer(work.model, directory, optimizer=work.optimizer, config=config) as ck:
        seconds = timed_load(lambda: restored.append(ck.load(step)))
    assert restored[0] is not None, f"{directory}: nothing to restore"
    return seconds


Load = tuple[str, Path, CheckpointConfig | None, int | None]
"""A load to time: its name, its directory, its config (None: ``dcp.load``), its step (None:
the latest)."""


def fresh_load_times(cfg: DemoConfig, loads: list[Load], repeats: int) -> dict[str, list[float]]:
    """Per load, by name: the slowest rank's seconds of it in fresh ranks, ``repeats`` rounds."""
    seconds: dict[str, list[float]] = {name: [] for name, *_ in loads}
    for turn in range(repeats):
        at = turn % len(loads)
        for name, directory, config, step in loads[at:] + loads[:at]:
            ranks: list[Any] = run_ranks(
                _load_once, cfg.world_size, cfg, str(directory), config, step
            )
            seconds[name].append(max(ranks))
    return seconds


def fresh_restore_times(
    cfg: DemoConfig,
    directories: dict[str, tuple[Path, CheckpointConfig]],
    dcp_dir: Path,
    repeats: int,
) -> dict[str, list[float]]:
    """Per directory (its latest checkpoint) and for ``dcp.load`` of ``dcp_dir`` (``DCP``):
    the slowest rank's seconds of one load in fresh ranks, ``repeats`` rounds."""
    loads: list[Load] = [(name, d, config, None) for name, (d, config) in directories.items()]
    return fresh_load_times(cfg, [*loads, (DCP, dcp_dir, None, None)], repeats)
