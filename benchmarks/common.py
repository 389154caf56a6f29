"""Shared pieces of the benchmark scripts: the machine description and the result writer."""

from __future__ import annotations

import json
import os
import platform
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
