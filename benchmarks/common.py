"""Shared pieces of the benchmark scripts: the machine description and the result writer."""

from __future__ import annotations

import json
import os
import platform
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
