"""How save and restore scale with the model: embckpt beside DCP at 1M, 4M and 16M rows.

For each size (``--sizes``, rows in all), 2 gloo ranks build a DLRM with 4 equal row-wise
tables of 64-dim rows and row-wise Adagrad, train a few steps, and then run ``--repeats``
rounds. Each round trains 2 more steps and times, on the same state:

* saves, in an order rotating by round: our full save (``policy="full"``), our one-shot diff
  save (a second checkpointer whose base full was written before the rounds) and ``dcp.save``
  (same writer threads, fsync on);
* then, untimed, a third checkpointer (``policy="incremental"``, ``full_every=6``) writes a
  full and 5 incremental diffs, one training step apart;
* restores into the live model, in an order rotating by round: our full checkpoint, our
  chain (the base full and the round's diff), the full + 5 diffs (``ours_chain5_restore``)
  and ``dcp.load``.

Each operation starts after a barrier and ends when every rank is done; its time is the slowest
rank's, its memory the largest rank's. Times: ``<op>_s`` is the median over rounds,
``best_s`` the fastest round, ``spread_s`` the distribution; ``vs_dcp`` divides our save by
``dcp.save`` and our restores by ``dcp.load``, best by best and median by median.

Then the last round's full, full + 5 diffs and ``dcp.load`` are timed again, each as the first
load of a fresh pair of ranks (``--fresh-repeats`` rounds, ``fresh_restore.py``: as a relaunched
job restores; in one process a load's time moves with the heap the load before it left):
``fresh`` gives the best and median seconds and ``vs_dcp`` of both.

Memory is the peak resident memory (``VmRSS`` of ``/proc/self/status``, sampled every 5 ms by a
thread) above the rank's resident memory after the first training steps, before any
checkpointing (so buffers a checkpointer keeps between saves, such as its staging arena,
count). ``peak_rss_over_baseline_bytes`` is measured first, in fresh processes with one
checkpointer alone (2 rounds of a full save and its restore): the timed rounds' three
checkpointers keep three arenas, and the allocators keep memory from DCP's operations, which
``peak_rss_bytes`` (the same peak, per operation of the timed rounds) includes;
``peak_rss_over_start_bytes`` is the peak there above the resident memory at the operation's
start. A save is within budget when its peak stays within ``staging_budget_bytes`` + 10%
(``save_within_budget``: alone; ``interleaved_save_within_budget``: in the timed rounds;
``..._over_start``); ``staging_peak_bytes`` is the largest high-water mark of staged plus
encoded bytes our full saves counted against that budget (``save/staging.py``). A size whose
estimated memory does not fit the machine's available memory is skipped, with the reason
recorded. Files go to ``--dir`` (default: a temporary folder), are read back from the page
cache, and are deleted after each round.

Writes ``benchmarks/results/scaling.json``.

Run: ``.venv/bin/python benchmarks/scaling.py [--sizes 1M,4M,16M] [--repeats 5]
[--fresh-repeats 3]``
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import (  # noqa: E402
    PeakRss,
    build_workload,
    cold_heap,
    dcp_save,
    dcp_state,
    dir_bytes,
    spread,
    write_result,
)
from fresh_restore import DCP, Load, fresh_load_times  # noqa: E402

from embckpt.config import CheckpointConfig  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig, WorkloadConfig  # noqa: E402

DIM = 64
TABLES = 4
WORLD = 2
WARMUP_STEPS = 3
SAVES = ("ours_save", "ours_diff_save", "dcp_save")
RESTORES = ("ours_restore", "ours_chain_restore", "ours_chain5_restore", "dcp_load")
CHAIN_DIFFS = 5
BUDGET_SLACK = 1.10


def parse_rows(text: str) -> int:
    """Rows as the command line spells them: 1M, 2.4M, 500K, 1G or a number."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def model_config(rows: int, budget: int, threads: int | None) -> DemoConfig:
    """The scaling model: ``rows`` in all over :data:`TABLES` equal row-wise tables."""
    workload = WorkloadConfig(
        cardinalities=(rows // TABLES,) * TABLES,
        embedding_dim=DIM,
        dense_arch=(128, DIM),
        over_arch=(128, 1),
        num_samples=65536,
        batch_size=512,
        sharding={f"t_cat_{i}": "row_wise" for i in range(TABLES)},
    )
    checkpoint = CheckpointConfig(staging_budget_bytes=budget, io_threads=threads)
    return DemoConfig(workload=workload, checkpoint=checkpoint, world_size=WORLD)


def _table_bytes(rows: int) -> int:
    """Weights and row-wise optimizer state of the whole model, fp32."""
    return rows * (DIM + 1) * 4


def _memory_needed(rows: int, budget: int) -> int:
    """A rough upper bound of the machine memory a size needs: per rank its share of the
    tables, the live model's copy made while sharding, the staging arena and the encoded files,
    and the page cache holding what was written (ours and DCP's)."""
    share = _table_bytes(rows) // WORLD
    per_rank = 2 * share + min(budget, share) + share // 2 + (1 << 30)
    return WORLD * per_rank


def _available() -> int:
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def _worker(rank: int, world_size: int, cfg: DemoConfig, root: str, repeats: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    model, optimizer = work.model, work.optimizer
    for _ in range(WARMUP_STEPS):
        work.step()
    baseline = PeakRss.rss()
    configs = _configs(cfg)
    full, chain, chain5 = (
        Checkpointer(model, f"{root}/{name}", optimizer=optimizer, config=configs[name])
        for name in ("full", "chain", "chain5")
    )
    step = WARMUP_STEPS
    base = chain.save(step).wait()  # the chain's base full, untimed
    assert base is not None and base.kind == "full"
    seconds: dict[str, list[float]] = {name: [] for name in SAVES + RESTORES}
    peaks: dict[str, int] = dict.fromkeys(SAVES + RESTORES, 0)
    op_peaks: dict[str, int] = dict.fromkeys(SAVES + RESTORES, 0)
    bytes_written: dict[str, int] = {}
    staging_peak = 0
    phases: dict[str, dict[str, float]] = {}  # the last round's, per save

    def timed(name: str, operation: Callable[[], Any]) -> None:
        if name in RESTORES:  # each from the heap a fresh process has (common.cold_heap)
            cold_heap()
        dist.barrier()
        started = time.perf_counter()
        with PeakRss() as memory:
            operation()
            dist.barrier()
        seconds[name].append(time.perf_counter() - started)
        peaks[name] = max(peaks[name], memory.peak - baseline)
        op_peaks[name] = max(op_peaks[name], memory.extra)

    for turn in range(repeats):
        for _ in range(2):
            work.step()
        step += 2
        dcp_dir = f"{root}/dcp/step_{step}"
        saves: dict[str, Callable[[], Any]] = {
            "ours_save": lambda s=step: phases.update(ours_save=_phases(full.save(s))),
            "ours_diff_save": lambda s=step: phases.update(ours_diff_save=_phases(chain.save(s))),
            "dcp_save": lambda d=dcp_dir: dcp_save(
                dcp_state(model, optimizer), d, cfg.checkpoint.io_threads
            ),
        }
        for name in SAVES[turn % 3 :] + SAVES[: turn % 3]:
            timed(name, saves[name])
        staging_peak = max(staging_peak, full._saver.arena.peak_bytes)
        chain5_steps = [step + i for i in range(CHAIN_DIFFS + 1)]
        for at in chain5_steps:  # a full, then the diffs, one training step apart
            if at != step:
                work.step()
            written = chain5.save(at).wait()
            assert written is not None and written.kind == ("full" if at == step else "diff")
        if rank == 0:
            bytes_written = {
                "ours_save": dir_bytes(full.store.step_path(step)),
                "ours_diff_save": dir_bytes(chain.store.step_path(step)),
                "dcp_save": dir_bytes(dcp_dir),
            }
        restores: dict[str, Callable[[], Any]] = {
            "ours_restore": lambda s=step: full.load(s),
            "ours_chain_restore": lambda s=step: chain.load(s),
            "ours_chain5_restore": lambda s=chain5_steps[-1]: chain5.load(s),
            "dcp_load": lambda d=dcp_dir: dcp.load(dcp_state(model, optimizer), checkpoint_id=d),
        }
        turns = turn % len(RESTORES)
        for name in RESTORES[turns:] + RESTORES[:turns]:
            timed(name, restores[name])
        dist.barrier()
        kept = {"full": step, "chain5": chain5_steps[-1], "dcp": dcp_dir}
        if rank == 0 and turn < repeats - 1:  # one round's files on disk; the last one stays
            full.store.remove_step(step)
            chain.store.remove_step(step)
            for at in chain5_steps:
                chain5.store.remove_step(at)
            shutil.rmtree(dcp_dir)
        dist.barrier()
        step = chain5_steps[-1]
    full.close()
    chain.close()
    chain5.close()
    return {
        "seconds": seconds,
        "peaks": peaks,
        "op_peaks": op_peaks,
        "bytes": bytes_written,
        "baseline": baseline,
        "phases": phases,
        "staging_peak": staging_peak,
        "kept": kept,
    }


def _memory_worker(rank: int, world_size: int, cfg: DemoConfig, root: str, repeats: int) -> dict:
    """The memory of our saves and restores alone: one checkpointer in a fresh process, so
    neither DCP nor the timed rounds' other checkpointers (each keeps a staging arena) add to
    the resident memory it is measured against."""
    import torch.distributed as dist

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    for _ in range(WARMUP_STEPS):
        work.step()
    baseline = PeakRss.rss()
    peaks = {"ours_save": 0, "ours_restore": 0}
    config = dataclasses.replace(cfg.checkpoint, policy="full", keep_last=1)
    with Checkpointer(work.model, root, optimizer=work.optimizer, config=config) as ckpt:
        step = WARMUP_STEPS
        for _ in range(repeats):
            for _ in range(2):
                work.step()
            step += 2
            for name, operation in (
                ("ours_save", lambda s=step: ckpt.save(s).wait()),
                ("ours_restore", lambda s=step: ckpt.load(s)),
            ):
                dist.barrier()
                with PeakRss() as memory:
                    operation()
                    dist.barrier()
                peaks[name] = max(peaks[name], memory.peak - baseline)
    return {"peaks": peaks}


def _phases(pending: Any) -> dict[str, float]:
    """Waits for a save; its manifest's phase seconds (the slowest rank's)."""
    manifest = pending.wait()
    assert manifest is not None
    return dict(manifest.stats["phase_seconds"])


def _measure(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = model_config(rows, args.budget, args.threads)
    root = args.dir or tempfile.mkdtemp(prefix="embckpt-scaling-")
    try:
        alone = run_ranks(_memory_worker, WORLD, cfg, f"{root}/alone", 2, timeout_s=args.timeout)
        results = run_ranks(_worker, WORLD, cfg, root, args.repeats, timeout_s=args.timeout)
        fresh = _fresh(cfg, Path(root), results[0]["kept"], args.fresh_repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    alone_peaks = {name: max(r["peaks"][name] for r in alone) for name in alone[0]["peaks"]}
    # An operation is done when every rank is: each round's time is the slowest rank's.
    seconds = {
        name: [max(r["seconds"][name][i] for r in results) for i in range(args.repeats)]
        for name in SAVES + RESTORES
    }
    spreads = {name: spread(values) for name, values in seconds.items()}
    peaks = {name: max(r["peaks"][name] for r in results) for name in SAVES + RESTORES}
    op_peaks = {name: max(r["op_peaks"][name] for r in results) for name in SAVES + RESTORES}
    limit = args.budget * BUDGET_SLACK
    versus = {"ours_save": "dcp_save", "ours_diff_save": "dcp_save"}
    versus.update({name: "dcp_load" for name in RESTORES if name != "dcp_load"})
    entry: dict[str, Any] = {
        "rows": rows,
        "bytes": _table_bytes(rows),
        **{f"{name}_s": spreads[name]["median"] for name in SAVES + RESTORES},
        "best_s": {name: spreads[name]["min"] for name in SAVES + RESTORES},
        "vs_dcp": {name: _versus(spreads, name, dcp) for name, dcp in versus.items()},
        "peak_rss_over_baseline_bytes": alone_peaks,
        "peak_rss_bytes": peaks,
        "staging_peak_bytes": max(r["staging_peak"] for r in results),
        "peak_rss_over_start_bytes": op_peaks,
        "spread_s": spreads,
        "files_bytes": results[0]["bytes"],
        "phase_seconds": results[0]["phases"],
        "baseline_rss_bytes": max(r["baseline"] for r in results),
        "save_vs_dcp": spreads["ours_save"]["median"] / spreads["dcp_save"]["median"],
        "diff_save_vs_dcp": spreads["ours_diff_save"]["median"] / spreads["dcp_save"]["median"],
        "restore_vs_dcp": spreads["ours_restore"]["median"] / spreads["dcp_load"]["median"],
        "chain5_restore_vs_dcp": spreads["ours_chain5_restore"]["median"]
        / spreads["dcp_load"]["median"],
        "fresh": fresh,
        "save_within_budget": alone_peaks["ours_save"] <= limit,
        "interleaved_save_within_budget": all(
            peaks[n] <= limit for n in ("ours_save", "ours_diff_save")
        ),
        "save_within_budget_over_start": all(
            op_peaks[n] <= limit for n in ("ours_save", "ours_diff_save")
        ),
    }
    return entry


def _configs(cfg: DemoConfig) -> dict[str, CheckpointConfig]:
    """The three checkpointers' configs, by folder: fulls, one-shot diffs on one full, and a
    full with :data:`CHAIN_DIFFS` incremental diffs."""
    return {
        "full": dataclasses.replace(cfg.checkpoint, policy="full"),
        "chain": dataclasses.replace(cfg.checkpoint, policy="one_shot", full_every=0),
        "chain5": dataclasses.replace(
            cfg.checkpoint, policy="incremental", full_every=CHAIN_DIFFS + 1
        ),
    }


def _versus(spreads: dict[str, dict[str, float]], name: str, dcp: str) -> dict[str, float]:
    """``name``'s time over ``dcp``'s, best by best and median by median."""
    return {
        "best": spreads[name]["min"] / spreads[dcp]["min"],
        "median": spreads[name]["median"] / spreads[dcp]["median"],
    }


def _fresh(
    cfg: DemoConfig, root: Path, kept: dict[str, Any], repeats: int
) -> dict[str, Any] | None:
    """The last round's full, full + 5 diffs and ``dcp.load`` timed again, each as the first
    load of fresh ranks (``fresh_restore.py`` says why the times differ from the rounds');
    None with ``repeats`` 0."""
    if not repeats:
        return None
    configs = _configs(cfg)
    loads: list[Load] = [
        ("ours_restore", root / "full", configs["full"], kept["full"]),
        ("ours_chain5_restore", root / "chain5", configs["chain5"], kept["chain5"]),
        (DCP, Path(kept["dcp"]), None, None),
    ]
    seconds = fresh_load_times(cfg, loads, repeats)
    spreads = {name: spread(values) for name, values in seconds.items()}
    return {
        "best_s": {name: s["min"] for name, s in spreads.items()},
        "median_s": {name: s["median"] for name, s in spreads.items()},
        "vs_dcp": {name: _versus(spreads, name, DCP) for name in spreads if name != DCP},
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M", help="rows in all, e.g. 1M,4M,16M")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per size")
    parser.add_argument(
        "--budget", type=int, default=1 << 30, help="staging_budget_bytes of our saves"
    )
    parser.add_argument("--threads", type=int, default=2, help="writer threads per rank")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per size")
    parser.add_argument(
        "--fresh-repeats",
        type=int,
        default=3,
        help="rounds of the last round's loads timed in fresh ranks (0: none)",
    )
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    for rows in (parse_rows(s) for s in args.sizes.split(",")):
        needed, available = _memory_needed(rows, args.budget), _available()
        if needed > available:
            results.append(
                {
                    "rows": rows,
                    "bytes": _table_bytes(rows),
                    "skipped": f"needs about {needed / 2**30:.1f} GiB, "
                    f"{available / 2**30:.1f} GiB available",
                }
            )
            print(f"{rows:>10} rows: skipped ({results[-1]['skipped']})")
            continue
        entry = _measure(rows, args)
        results.append(entry)
        best, peak = entry["best_s"], entry["peak_rss_over_baseline_bytes"]
        print(
            f"{rows:>10} rows: save {entry['ours_save_s']:.2f} s best {best['ours_save']:.2f} "
            f"(dcp {entry['dcp_save_s']:.2f} best {best['dcp_save']:.2f}), "
            f"diff {entry['ours_diff_save_s']:.2f} s, restore {entry['ours_restore_s']:.2f} s "
            f"best {best['ours_restore']:.2f}, full+5 {entry['ours_chain5_restore_s']:.2f} s "
            f"best {best['ours_chain5_restore']:.2f} (dcp {entry['dcp_load_s']:.2f} best "
            f"{best['dcp_load']:.2f}); peak over baseline: save "
            f"{peak['ours_save'] / 2**20:.0f} MiB, restore {peak['ours_restore'] / 2**20:.0f} "
            f"MiB, staging {entry['staging_peak_bytes'] / 2**20:.0f} MiB"
        )
        if entry["fresh"] is not None:
            ratios = entry["fresh"]["vs_dcp"]
            print(
                f"{'':>10}       fresh ranks: restore {ratios['ours_restore']['best']:.2f}x, "
                f"full+5 {ratios['ours_chain5_restore']['best']:.2f}x dcp.load (best; median "
                f"{ratios['ours_restore']['median']:.2f}x, "
                f"{ratios['ours_chain5_restore']['median']:.2f}x)"
            )
    path = write_result(
        "scaling",
        {
            "method": __doc__.split("\n\n", 1)[1].split("Writes ``")[0].strip(),
            "parameters": {
                "dim": DIM,
                "tables": TABLES,
                "world_size": WORLD,
                "repeats": args.repeats,
                "staging_budget_bytes": args.budget,
                "io_threads": args.threads,
                "optimizer": "exact_rowwise_adagrad",
            },
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
