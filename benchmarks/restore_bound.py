"""Calibrates the default restore bound: how many encoded bytes our restore reads in the time
``dcp.load`` reads the same model's full fp32 checkpoint.

For each workload of ``--only`` (shapes of ``benchmarks/family.py``), 2 gloo ranks train and
checkpoint with the headline setting's codecs (adaptive 4-bit, delta diffs) under
``policy: incremental`` with no forced full: one full, then ``--intervals - 1`` incremental
diffs, ``every`` steps apart. The final state is also saved with ``dcp.save``. Then, in
``--repeats`` rounds, every rank restores (into the live model) the checkpoints at chain
positions ``--points`` and runs ``dcp.load``, in turn, between barriers, each from a trimmed
heap (``common.cold_heap``); a time is the slowest rank's, and the best round's counts. The
same loads are then timed each as the first load of fresh ranks, ``--repeats`` rounds
(``fresh``: the same fit, ``fresh_restore.py`` says why the two differ).

Each restore reads its chain: ``s`` = its bytes over the fp32 checkpoint's (the model's rows
and optimizer state at fp32). A least-squares line ``t = a + b s`` through the restores gives
``s_dcp = (t_dcp - a) / b``: the share of the fp32 checkpoint our restore reads in
``dcp.load``'s time. ``summary.min_s_dcp`` over the workloads is what the default bound
(``policy.COST_MAX_RESTORE_FP32``) may be at most. What a link costs beyond its bytes:
``s_per_link`` (the first point to the last, per link) less the link's bytes at the rate the
full restored at (``s_per_link_beyond_bytes``; ``summary.max_s_per_link_beyond_bytes``;
in fresh ranks: ``summary.min_s_dcp_fresh``, ``summary.max_s_per_link_beyond_bytes_fresh``).
Writes ``benchmarks/results/restore_bound.json``.

Run: ``python benchmarks/restore_bound.py [--only NAME] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, dcp_save, dcp_state, timed_load, write_result  # noqa: E402
from family import FAMILY, Member, chain_config  # noqa: E402
from fresh_restore import DCP, Load, fresh_load_times  # noqa: E402

from embckpt.examples.launcher import run_ranks  # noqa: E402


def _worker(
    rank: int, world_size: int, member: Member, root: str, points: list[int], repeats: int
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer

    cfg = member.demo_config(world_size)
    config = chain_config()
    work = build_workload(rank, world_size, cfg)
    for _ in range(member.warmup):
        work.step()
    steps, chain_bytes, fp32 = [], [], 0
    with Checkpointer(work.model, f"{root}/ours", optimizer=work.optimizer, config=config) as ck:
        for interval in range(max(points) + 1):
            for _ in range(member.every):
                work.step()
            step = member.warmup + (interval + 1) * member.every
            manifest = ck.save(step).wait()
            assert manifest is not None
            steps.append(step)
            chain_bytes.append((chain_bytes[-1] if interval else 0) + manifest.total_bytes)
            fp32 = manifest.stats["full_fp32_bytes"]
        dcp_save(dcp_state(work.model, work.optimizer), f"{root}/dcp", threads=2)
        seconds: dict[str, list[float]] = {str(p): [] for p in points}
        seconds["dcp_load"] = []
        for _ in range(repeats):
            for point in points:
                seconds[str(point)].append(timed_load(functools.partial(ck.load, steps[point])))
            seconds["dcp_load"].append(
                timed_load(
                    lambda: dcp.load(
                        dcp_state(work.model, work.optimizer), checkpoint_id=f"{root}/dcp"
                    )
                )
            )
    return {"seconds": seconds, "chain_bytes": chain_bytes, "fp32": fp32, "steps": steps}


def _fit(
    points: list[int], shares: list[float], best: list[float], dcp_best: float, fp32: int
) -> dict[str, Any]:
    """The line ``t = a + b s`` through the restores, ``s_dcp``, and what a link costs."""
    slope, intercept = np.polyfit(shares, best, 1)
    links = points[-1] - points[0]
    per_link = (best[-1] - best[0]) / links if links else 0.0
    full_rate = best[0] / (shares[0] * fp32)  # seconds per byte, restoring the full
    link_bytes = (shares[-1] - shares[0]) * fp32 / links if links else 0.0
    return {
        "restore_s_best": best,
        "dcp_load_s_best": dcp_best,
        "fit_intercept_s": float(intercept),
        "fit_s_per_fp32_share": float(slope),
        "s_dcp": float((dcp_best - intercept) / slope) if slope > 0 else None,
        "s_per_link": per_link,
        "s_per_link_beyond_bytes": per_link - link_bytes * full_rate,
    }


def calibrate(member: Member, points: list[int], repeats: int) -> dict[str, Any]:
    """One workload's restores along its chain, ``dcp.load``, and the fitted ``s_dcp``: timed
    in the training processes, and each load as the first of fresh ranks (``fresh``)."""
    started = time.perf_counter()
    cfg = member.demo_config(2)
    config = chain_config()
    with tempfile.TemporaryDirectory() as root:
        ranks = run_ranks(_worker, 2, member, root, points, repeats, timeout_s=3600)
        steps = ranks[0]["steps"]
        loads: list[Load] = [(str(p), Path(root, "ours"), config, steps[p]) for p in points]
        loads.append((DCP, Path(root, "dcp"), None, None))
        fresh_seconds = fresh_load_times(cfg, loads, repeats)
    seconds = {
        name: np.max([r["seconds"][name] for r in ranks], axis=0).tolist()
        for name in ranks[0]["seconds"]
    }
    fp32 = ranks[0]["fp32"]
    shares = [ranks[0]["chain_bytes"][p] / fp32 for p in points]
    best = [min(seconds[str(p)]) for p in points]
    row = {
        "workload": member.name,
        "total_rows": sum(member.cardinalities()),
        "dim": member.dim,
        "full_fp32_bytes": fp32,
        "points": points,
        "chain_share_of_fp32": shares,
        **_fit(points, shares, best, min(seconds["dcp_load"]), fp32),
        "seconds": seconds,
        "fresh": {
            **_fit(
                points,
                shares,
                [min(fresh_seconds[str(p)]) for p in points],
                min(fresh_seconds[DCP]),
                fp32,
            ),
            "seconds": fresh_seconds,
        },
        "runtime_s": time.perf_counter() - started,
    }
    fresh = row["fresh"]
    print(
        f"{member.name:>15}: chain shares {[round(s, 3) for s in shares]} restore "
        f"{[round(t, 3) for t in best]} s, dcp.load {row['dcp_load_s_best']:.3f} s -> s_dcp "
        f"{row['s_dcp'] if row['s_dcp'] is None else round(row['s_dcp'], 3)}, per link "
        f"{row['s_per_link'] * 1e3:.1f} ms; fresh ranks "
        f"{[round(t, 3) for t in fresh['restore_s_best']]} s, dcp.load "
        f"{fresh['dcp_load_s_best']:.3f} s, per link {fresh['s_per_link'] * 1e3:.1f} ms",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    names = [m.name for m in FAMILY]
    parser.add_argument("--only", action="append", choices=names, default=[])
    parser.add_argument("--points", default="0,4,9,14", help="chain positions restored")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (the best counts)")
    args = parser.parse_args()
    points = [int(p) for p in args.points.split(",")]
    chosen = args.only or ["zipf1.0_dim32", "zipf1.4_dim64", "rows10M_dim16"]
    members = [dataclasses.replace(m, intervals=max(points) + 1) for m in FAMILY]
    results = [calibrate(m, points, args.repeats) for m in members if m.name in chosen]
    found = [r["s_dcp"] for r in results if r["s_dcp"] is not None]
    beyond = [r["s_per_link_beyond_bytes"] for r in results]
    fresh_found = [r["fresh"]["s_dcp"] for r in results if r["fresh"]["s_dcp"] is not None]
    fresh_beyond = [r["fresh"]["s_per_link_beyond_bytes"] for r in results]
    summary = {
        "min_s_dcp": min(found) if found else None,
        "s_dcp": found,
        "max_s_per_link_beyond_bytes": max(beyond) if beyond else None,
        "min_s_dcp_fresh": min(fresh_found) if fresh_found else None,
        "max_s_per_link_beyond_bytes_fresh": max(fresh_beyond) if fresh_beyond else None,
    }
    path = write_result(
        "restore_bound", {"args": vars(args), "results": results, "summary": summary}
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
