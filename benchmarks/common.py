"""Shared pieces of the benchmark scripts: the machine description and the result writer."""

from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import pyarrow
    import torch
    import torchrec

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": torchrec.__version__ if hasattr(torchrec, "__version__") else "?",
        "pyarrow": pyarrow.__version__,
    }


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Writes ``benchmarks/results/<name>.json`` with the machine described."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **result}, indent=1))
    return path


@dataclass
class Workload:
    """One rank's reference workload: data, sampler, sharded DLRM and its dense optimizer."""

    config: Any  # WorkloadConfig
    device: Any
    dataset: Any
    sampler: Any
    model: Any
    optimizer: Any

    def step(self) -> float:
        """Trains on this rank's next batch and returns its loss."""
        from embckpt.examples.model import make_batch, train_step

        batch = make_batch(self.dataset, next(self.sampler), self.config, self.device)
        return train_step(self.model, self.optimizer, batch)


def build_workload(rank: int, world_size: int, cfg: Any, dataset: Any = None) -> Workload:
    """Builds the workload of ``cfg`` (a DemoConfig) on this rank; reuses ``dataset`` if given."""
    from embckpt.data import ResumableSampler
    from embckpt.examples.demo import load_dataset
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model

    device = rank_device(rank)
    dataset = dataset if dataset is not None else load_dataset(cfg)
    sampler = ResumableSampler(
        len(dataset), cfg.workload.batch_size, rank=rank, world_size=world_size, seed=0
    )
    model, optimizer = build_model(cfg.workload, device, world_size)
    return Workload(cfg.workload, device, dataset, sampler, model, optimizer)


def dcp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """What ``dcp.save`` saves of a sharded model: weights, fused and dense optimizer state."""
    return {
        "model": model.state_dict(),
        "optim": model.fused_optimizer.state_dict(),
        "dense_optim": optimizer.state_dict(),
    }


def dcp_save(state: dict[str, Any], path: str, threads: int) -> None:
    """``dcp.save`` with ``threads`` writer threads per rank and fsync on, as our saves have."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=True)
    dcp.save(state, storage_writer=writer)


def cold_heap() -> None:
    """Gives the C heap's free pages back to the system before a timed restore or ``dcp.load``
    (call it before the barrier that starts the clock), so that each starts as it would in a
    fresh process, its buffers' pages faulted in, whatever ran before it.

    Why: a restore of ours ends by trimming the heap (``embckpt/read/heap.py``), so a
    ``dcp.load`` timed right after one faulted its buffers' pages in, while one timed after
    another ``dcp.load`` reused them: on ``family.py``'s long_interval model (2 gloo ranks, the
    2-core machine of ``results/``) ``dcp.load`` took 25-27 ms best repeated alone and 33-42
    ms right after a restore of ours, 27-29 ms when that restore skipped its trim. Which side
    went first then moved a comparison by that much.
    """
    from embckpt.read.heap import trim_heap

    trim_heap()


def timed_load(load: Callable[[], Any]) -> float:
    """Seconds of ``load()`` (a restore or ``dcp.load``) between barriers of the default
    group, from a trimmed heap (:func:`cold_heap`); every rank calls it together."""
    import torch.distributed as dist

    cold_heap()
    dist.barrier()
    started = time.perf_counter()
    load()
    dist.barrier()
    return time.perf_counter() - started


def dir_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def spread(values: list[float]) -> dict[str, float]:
    """Median and spread of repeated timings (seconds)."""
    ordered = sorted(values)
    if not ordered:
        return {}

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "p25": quantile(0.25),
        "p75": quantile(0.75),
        "max": ordered[-1],
        "n": len(ordered),
    }


def median_phases(phases: list[dict[str, float]]) -> dict[str, float]:
    """The median, phase by phase, of several saves' ``phase_seconds``."""
    if not phases:
        return {}
    return {name: statistics.median(p[name] for p in phases) for name in phases[0]}


class PeakRss:
    """Peak resident memory of this process during a block, above its level at the start.

    A thread samples ``VmRSS`` of ``/proc/self/status`` every ``interval_s`` (the kernel's
    ``VmHWM`` high-water mark cannot be reset, so it would report the peak of an earlier
    operation); a peak shorter than the interval can be missed.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("/proc/self/status has no VmRSS line")

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> PeakRss:
        self.baseline = self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        """Bytes above the level at the start."""
        return self.peak - self.baseline
