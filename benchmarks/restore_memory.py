"""Resident memory across repeated restores in one process: a leak, or the allocator keeping
freed memory?

2 gloo ranks train the ``scaling.py`` model (4 row-wise tables of 64-dim rows, row-wise
Adagrad; ``--rows`` rows in all) a few steps and write a full checkpoint and 5 incremental diffs.
Then, per mode, each rank ``--restores`` times in one process: builds a fresh sharded model,
restores (``full``: the full checkpoint; ``chain``: the last diff, full + 5 diffs applied;
``build``: no restore, the control), closes the checkpointer, drops model and checkpointer and
runs ``gc.collect()``. After each it records:

* ``rss``: ``VmRSS`` of ``/proc/self/status``;
* ``heap_in_use`` / ``heap_held``: glibc's ``mallinfo2()`` bytes in use and held (in use +
  free inside the heap arenas, plus mmapped chunks): held far above in use is memory the
  allocator keeps, not a live object;
* ``tensors``, ``arrays``: torch tensors and numpy arrays the garbage collector tracks; live
  Python threads; open file descriptors; memory maps (``/proc/self/maps`` lines); whether a
  weak reference to the dropped model or checkpointer is still alive.

After the last, it calls glibc's ``malloc_trim(0)`` and records the resident memory again
(``rss_after_trim``): what falls back was kept by the allocator, what stays is held by a live
reference. The goal (issue 22, part 4): the last restore's resident memory within 10% of the
first's (``within_10pct``). Each mode runs in fresh processes, so modes do not see each other's
memory.

Writes ``benchmarks/results/restore_memory.json``.

Run: ``.venv/bin/python benchmarks/restore_memory.py [--rows 2M] [--restores 20]``
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, write_result  # noqa: E402
from scaling import DIM, TABLES, WORLD, model_config, parse_rows  # noqa: E402

from embckpt.config import CheckpointConfig  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

DIFFS = 5
MODES = ("build", "full", "chain")
SLACK = 1.10


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _sample(libc: Any) -> dict[str, int]:
    import numpy as np
    import torch

    info = libc.mallinfo2()
    objects = gc.get_objects()
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for _ in maps)
    return {
        "rss": _status("VmRSS"),
        "heap_in_use": int(info.uordblks + info.hblkhd),
        "heap_held": int(info.arena + info.hblkhd),
        "tensors": sum(1 for o in objects if isinstance(o, torch.Tensor)),
        "arrays": sum(1 for o in objects if isinstance(o, np.ndarray)),
        "threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "maps": mapped,
    }


def _write_chain(rank: int, world_size: int, cfg: DemoConfig, root: str) -> tuple[int, int]:
    """Trains and writes a full checkpoint and ``DIFFS`` diffs; the full's and last step."""
    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    steps = []
    with Checkpointer(work.model, root, optimizer=work.optimizer, config=cfg.checkpoint) as ckpt:
        for step in range(1, DIFFS + 2):
            for _ in range(2):
                work.step()
            manifest = ckpt.save(step).wait()
            assert manifest is not None
            assert manifest.kind == ("full" if step == 1 else "diff"), manifest.kind
            steps.append(step)
    return steps[0], steps[-1]


def _worker(rank: int, world_size: int, cfg: DemoConfig, root: str, mode: str, n: int) -> dict:
    from embckpt import Checkpointer
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model

    libc = _libc()
    device = rank_device(rank)
    full_step, last_step = 1, DIFFS + 1
    series: list[dict[str, Any]] = []
    for _ in range(n):
        model, optimizer = build_model(cfg.workload, device, world_size)
        ckpt = Checkpointer(model, root, optimizer=optimizer, config=cfg.checkpoint)
        seconds = None
        if mode != "build":
            result = ckpt.load(full_step if mode == "full" else last_step)
            assert result is not None and len(result.chain) == (1 if mode == "full" else DIFFS + 1)
            seconds = result.seconds
        ckpt.close()
        model_ref, ckpt_ref = weakref.ref(model), weakref.ref(ckpt)
        del model, optimizer, ckpt
        gc.collect()
        sample = _sample(libc)
        sample["model_alive"] = model_ref() is not None
        sample["checkpointer_alive"] = ckpt_ref() is not None
        sample["restore_s"] = seconds  # type: ignore[assignment]
        series.append(sample)
    gc.collect()
    before = _status("VmRSS")
    libc.malloc_trim(0)
    return {"series": series, "rss_before_trim": before, "rss_after_trim": _status("VmRSS")}


def _summary(rank_results: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = []
    for result in rank_results:
        rss = [s["rss"] for s in result["series"]]
        per_rank.append(
            {
                "rss_first": rss[0],
                "rss_last": rss[-1],
                "rss_max": max(rss),
                "growth_bytes": rss[-1] - rss[0],
                "growth_per_restore_bytes": (rss[-1] - rss[0]) / max(1, len(rss) - 1),
                "last_over_first": rss[-1] / rss[0],
                "rss_after_trim": result["rss_after_trim"],
                "trim_released_bytes": result["rss_before_trim"] - result["rss_after_trim"],
                "heap_held_growth_bytes": result["series"][-1]["heap_held"]
                - result["series"][0]["heap_held"],
                "heap_in_use_growth_bytes": result["series"][-1]["heap_in_use"]
                - result["series"][0]["heap_in_use"],
                "tensors_growth": result["series"][-1]["tensors"] - result["series"][0]["tensors"],
                "threads_last": result["series"][-1]["threads"],
                "anything_alive": any(
                    s["model_alive"] or s["checkpointer_alive"] for s in result["series"]
                ),
            }
        )
    return {
        "per_rank": per_rank,
        "within_10pct": all(r["rss_last"] <= SLACK * r["rss_first"] for r in per_rank),
        "series": [r["series"] for r in rank_results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="2M", help="rows in all, e.g. 2M")
    parser.add_argument("--restores", type=int, default=20, help="restores per mode")
    parser.add_argument("--modes", default=",".join(MODES), help="of build, full, chain")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per mode")
    parser.add_argument("--name", default="restore_memory", help="result file name")
    args = parser.parse_args()
    rows = parse_rows(args.rows)
    # The scaling model, checkpointed as a full and incremental diffs.
    defaults = CheckpointConfig()
    cfg = dataclasses.replace(
        model_config(rows, defaults.staging_budget_bytes, defaults.io_threads),
        checkpoint=CheckpointConfig(policy="incremental", full_every=0),
    )
    root = args.dir or tempfile.mkdtemp(prefix="embckpt-restore-memory-")
    results: dict[str, Any] = {}
    try:
        run_ranks(_write_chain, WORLD, cfg, root, timeout_s=args.timeout)
        for mode in args.modes.split(","):
            found = run_ranks(
                _worker, WORLD, cfg, root, mode, args.restores, timeout_s=args.timeout
            )
            results[mode] = _summary(found)
            for rank, r in enumerate(results[mode]["per_rank"]):
                print(
                    f"{mode:>6} rank {rank}: rss {r['rss_first'] / 2**20:.0f} -> "
                    f"{r['rss_last'] / 2**20:.0f} MiB (x{r['last_over_first']:.3f}), "
                    f"after trim {r['rss_after_trim'] / 2**20:.0f} MiB, heap held "
                    f"+{r['heap_held_growth_bytes'] / 2**20:.0f} MiB, in use "
                    f"+{r['heap_in_use_growth_bytes'] / 2**20:.0f} MiB, tensors "
                    f"+{r['tensors_growth']}, threads {r['threads_last']}, "
                    f"alive {r['anything_alive']}"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = write_result(
        args.name,
        {
            "method": __doc__.split("\n\n", 1)[1].split("Writes ``")[0].strip(),
            "parameters": {
                "rows": rows,
                "dim": DIM,
                "tables": TABLES,
                "world_size": WORLD,
                "diffs": DIFFS,
                "restores": args.restores,
                "optimizer": "exact_rowwise_adagrad",
                "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
            },
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
