"""Training time a save costs, step by step: the ``lost`` phase of ``benchmarks/stall.py``.

Definition (issue 38): the wall time of the steps from ``save()`` until the checkpoint is
durable, ``save()`` itself included, minus the same number of steps trained right after it
without a save (interleaved: every save is followed by its own baseline). Each step is timed on
its own, the device synchronised at its end, so that a step's time is its own.

Cases, each on the model of ``stall.py``:

- ``headline``: the setting this project is for (intermittent policy, adaptive 4-bit rows),
  a save every ``--save-every`` steps; its first save is a full, the next ones mostly diffs;
  each save is counted under ``headline_full`` or ``headline_diff`` by its manifest's kind;
- ``raw_full``: the default codec (lossless ``raw``), every save a full;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the model's state dict, with
  its process-based checkpointer where the installed torch has one (``dcp_async_mode``).

Per case: lost seconds per save (median over saves), ``save()``'s blocking time, the seconds
until every row was copied off the model (``PendingCheckpoint.copied_s``) and until durable,
and each window step's time over the median step without a save (p50, p99, max). Then the step
overhead at one save per ``--overhead-steps`` steps: the lost time over that many steps (the
summary's figure), and measured directly, blocks of that many steps with and without a save
interleaved (``overhead_*_direct``).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

HEADLINE = {"policy": "intermittent", "full_every": 0, "codec": "adaptive", "bits": 4}
RAW_FULL = {"policy": "full"}


def timed_steps(train: Any, count: int) -> list[float]:
    """``count`` steps, each timed to its end (device synchronised)."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        train.step()
        train.sync()
        times.append(time.perf_counter() - started)
    return times


def measure_save(train: Any, start: Any) -> dict[str, Any]:
    """One save started by ``start()`` (returns a handle with ``done()``), the steps trained
    until it is durable, then as many steps without a save."""
    train.sync()
    began = time.perf_counter()
    handle = start()
    blocked = time.perf_counter() - began
    window = []
    while not handle.done():
        window.extend(timed_steps(train, 1))
    durable = time.perf_counter() - began
    baseline = timed_steps(train, max(len(window), 3))
    median = statistics.median(baseline)
    return {
        "handle": handle,
        "blocked_s": blocked,
        "durable_s": durable,
        "steps": len(window),
        "lost_s": blocked + sum(window) - median * len(window),
        "median_step_s": median,
        "ratios": [t / median for t in window],
    }


def summarise(saves: list[dict[str, Any]]) -> dict[str, Any]:
    """Median figures over saves, and the window step ratios over all their steps."""
    ratios = sorted(r for s in saves for r in s["ratios"])

    def pick(q: float) -> float | None:
        return ratios[min(int(q * len(ratios)), len(ratios) - 1)] if ratios else None

    keys = (
        "lost_s",
        "blocked_s",
        "durable_s",
        "copied_s",
        "steps",
        "dirty_fraction",
        "median_step_s",
        "writer_process_peak_rss_bytes",
    )
    out: dict[str, Any] = {"saves": len(saves)}
    for key in keys:
        values = [s[key] for s in saves if s.get(key) is not None]
        out[key] = statistics.median(values) if values else None
        out[f"{key}_each"] = values
    out.update(step_ratio_p50=pick(0.5), step_ratio_p99=pick(0.99), step_ratio_max=pick(1.0))
    return out


def ours(train: Any, folder: Path, options: dict[str, Any], saves: int, every: int) -> list:
    """``saves`` saves of a Checkpointer with ``options``, ``every`` steps apart (the first
    after a warm-up of ``every`` steps), each measured; its kind and dirty fraction added."""
    from embckpt import CheckpointConfig, Checkpointer

    config = CheckpointConfig(keep_last=2, **options)
    measured = []
    with Checkpointer(train.model, str(folder), optimizer=train.opt, config=config) as ckpt:
        for n in range(1, saves + 1):
            timed_steps(train, every)
            save = measure_save(train, lambda n=n: ckpt.save(n * every))
            manifest = save["handle"].wait()
            save.update(
                kind=manifest.kind,
                dirty_fraction=manifest.stats.get("dirty_fraction"),
                copied_s=getattr(save.pop("handle"), "copied_s", None),
                rows=manifest.stats.get("rows_written"),
            )
            measured.append(save)
        process = getattr(ckpt._saver, "process", None)
        if process is not None and measured:  # the writer process's peak resident memory
            measured[-1]["writer_process_peak_rss_bytes"] = _peak_rss(process.pid)
    shutil.rmtree(folder, ignore_errors=True)
    return measured


def _peak_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(x for x in status if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def dcp_async(train: Any, root: Path, saves: int, every: int) -> tuple[list, str]:
    """``dcp.async_save`` of the model's state dict, process-based where available."""
    import torch.distributed.checkpoint as dcp

    options: dict[str, Any] = {}
    mode = "thread (the default; this torch has no process-based async checkpointer)"
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        options["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        mode = "process"
    except ImportError:
        pass
    measured = []
    for n in range(saves):
        timed_steps(train, every)
        folder = root / f"dcp_async{n}"
        state = {"model": train.model.state_dict()}
        save = measure_save(
            train,
            lambda f=folder, s=state: _future(dcp.async_save(s, checkpoint_id=str(f), **options)),
        )
        save["handle"].result()
        save.pop("handle")
        measured.append(save)
        shutil.rmtree(folder, ignore_errors=True)
    return measured, mode


def _future(response: Any) -> Any:
    """The future that completes when the save is durable (torch returns an
    ``AsyncSaveResponse`` holding it where staging is asynchronous too)."""
    return getattr(response, "upload_completion", response)


def overhead(train: Any, root: Path, options: dict[str, Any], steps: int) -> dict[str, Any]:
    """Mean step time over blocks of ``steps`` steps holding one save (the Checkpointer's
    second and third: the first pays the process's first full) against blocks of as many steps
    without one, interleaved; percent."""
    from embckpt import CheckpointConfig, Checkpointer

    config = CheckpointConfig(keep_last=2, **options)
    folder = root / "overhead"
    with_save, without = [], []
    with Checkpointer(train.model, str(folder), optimizer=train.opt, config=config) as ckpt:
        handle = ckpt.save(0)
        timed_steps(train, 1)
        handle.wait()
        for n in (1, 2):
            without.append(sum(timed_steps(train, steps)))
            train.sync()
            started = time.perf_counter()
            handle = ckpt.save(n * 2 * steps)
            timed_steps(train, steps)
            if not handle.done():  # the save outlasted its block: its wait counts too
                handle.wait()
            with_save.append(time.perf_counter() - started)
            handle.wait()
    shutil.rmtree(folder, ignore_errors=True)
    pct = 100 * (statistics.median(with_save) / statistics.median(without) - 1)
    return {"pct": pct, "with_save_s": with_save, "without_s": without}


def lost_phase(train: Any, root: Path, args: Any) -> dict[str, Any]:
    """Every case, then the overheads at one save per ``--overhead-steps`` steps."""
    every, saves = args.save_every, args.lost_saves
    writer = {} if args.writer == "auto" else {"writer": args.writer}  # older releases: none
    headline_options = {**HEADLINE, **writer}
    raw_options = {**RAW_FULL, **writer}
    headline = ours(train, root / "headline", headline_options, saves + 1, every)
    raw = ours(train, root / "raw", raw_options, saves, every)
    cases = {
        "headline_full": summarise([s for s in headline if s["kind"] == "full"]),
        "headline_diff": summarise([s for s in headline if s["kind"] == "diff"]),
        "raw_full": summarise(raw),
    }
    mode = None
    try:
        dcp_saves, mode = dcp_async(train, root, saves, every)
        cases["dcp_async"] = summarise(dcp_saves)
    except Exception as exc:  # its staging of TorchRec's ShardedTensors fails on some releases
        cases["dcp_async"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out: dict[str, Any] = {
        "lost_cases": cases,
        "lost_s_per_save": {k: v.get("lost_s") for k, v in cases.items()},
        "dcp_async_mode": mode,
        "window_step_ratio_p50": _worst(cases, "step_ratio_p50"),
        "window_step_ratio_p99": _worst(cases, "step_ratio_p99"),
        "window_step_ratio_max": _worst(cases, "step_ratio_max"),
        "copied_s_headline_diff": cases["headline_diff"].get("copied_s"),
        "durable_s_headline_diff": cases["headline_diff"].get("durable_s"),
    }
    # One save per N steps costs its lost time over N steps: from the interleaved figures
    # above. The direct measurement (blocks of N steps with and without a save) is kept
    # beside it: where step times drift by more than the save costs (a shared CPU), only the
    # first resolves a percent or two.
    steps = args.overhead_steps
    for name, case in (("headline", "headline_diff"), ("raw_full", "raw_full")):
        lost, step = cases[case].get("lost_s"), cases[case].get("median_step_s")
        derived = None if lost is None or not step else 100 * lost / (steps * step)
        out[f"step_overhead_pct_{name}_1_per_{steps}"] = derived
    for name, options in (("headline", headline_options), ("raw_full", raw_options)):
        if args.overhead_direct:
            out[f"overhead_{name}_direct"] = overhead(train, root, options, steps)
    return out


def _worst(cases: dict[str, dict[str, Any]], key: str) -> float | None:
    """The largest figure among embckpt's own cases (DCP's is reported in its case)."""
    values = [v.get(key) for k, v in cases.items() if k != "dcp_async" and v.get(key) is not None]
    return max(values) if values else None
