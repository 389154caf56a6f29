"""The demo: train the reference DLRM on N ranks with checkpoints, kill every worker between two
checkpoints, start new workers that restore and finish, then report what checkpoints cost.

This is the failure a checkpointer exists for, done for real: the first workers die by SIGKILL
(no clean-up runs), and the second set of processes knows nothing but the checkpoint directory.

The configured run (``configs/demo.yaml``: Criteo-shaped tables of up to 600k rows with skewed
ids, lossless rows under the intermittent policy) is followed by the same run, killed at the
same steps, with the setting the project is for (``HEADLINE``: the intermittent policy and
adaptive 4-bit rows), and by one uninterrupted run without checkpoints. The demo ends with both
settings side by side: full checkpoints among all, bytes against full fp32 checkpoints, and
final AUC against the uninterrupted run's; then where to look next.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from embckpt import CheckpointConfig, CheckpointStore, load_yaml, verify
from embckpt.examples.launcher import RankFailed, rank_device, run_ranks
from embckpt.examples.workload import DemoConfig
from embckpt.report import build_report, format_bytes, render_png, write_html

HOLDOUT_FRACTION = 0.1
REPORT_FILES = ("report.png", "report.html")  # written next to the checkpoints
# The setting the project is for: one-shot diffs with a full when the predictor says a full is
# cheaper (no fixed cadence), rows quantized to 4 bits per value with per-row adaptive ranges.
HEADLINE: dict[str, Any] = {
    "policy": "intermittent",
    "full_every": 0,
    "codec": "adaptive",
    "bits": 4,
}
HEADLINE_DIR = "intermittent_adaptive4"  # the headline run's checkpoints, inside --out

# Third-party warnings every rank prints, known to be harmless here; each is matched by its
# category, message and module, so any other warning still shows:
# - torchrec wraps data-parallel tables and dense modules in DistributedDataParallel with
#   ``broadcast_buffers``, which torch now calls deprecated (the call still works as before).
# - torchrec's collectives call ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, which
#   torch renamed; the old names are aliases.
# - fbgemm's CPU kernel for the data-parallel table (``dense_embedding_codegen_lookup_function``)
#   builds its own autograd graph below the Autograd dispatch key, so torch warns that no
#   autograd kernel is registered; the table does train (its rows change between checkpoints).
_KNOWN_WARNINGS = (
    (FutureWarning, r"`broadcast_buffers` is deprecated", r"torchrec\.distributed\."),
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", r"torch\."),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"torch\."),
    (
        UserWarning,
        r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel",
        r"torch\.",
    ),
)
# Log records at WARNING level that are informational: torchrec announcing its process groups
# and defaults, torch.fx announcing an API change. Matched by logger and message start.
_KNOWN_LOG_LINES = {
    "torchrec.distributed.comm": ("[Connection] ", "TORCHREC_RESOLVED_POD_SIZE not set"),
    "torchrec.distributed.utils": ("Sharding Type is data_parallel, caching params",),
    "torch.fx._symbolic_trace": ("is_fx_tracing will return true",),
}


def quiet_known_warnings() -> None:
    """Hides the warnings listed in ``_KNOWN_WARNINGS`` and ``_KNOWN_LOG_LINES``, and no other."""
    for category, message, module in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, starts in _KNOWN_LOG_LINES.items():
        logging.getLogger(name).addFilter(_DropLines(starts))


class _DropLines(logging.Filter):
    """Drops the log records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def load_dataset(cfg: DemoConfig) -> Any:
    """The workload's data: Criteo TSV when ``data_path`` is set, else the synthetic log."""
    from embckpt.examples.criteo import load_criteo_tsv
    from embckpt.examples.synthetic import make_synthetic_dataset

    workload = cfg.workload
    if workload.data_path:
        return load_criteo_tsv(workload.data_path, workload, max_rows=workload.num_samples)
    return make_synthetic_dataset(workload)


def train_worker(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    out: str | None,
    kill_at: int | None,
    label: str = "train",
) -> dict:
    """One rank of the demo: restore if there is a checkpoint, train, checkpoint, maybe die.
    Without ``out`` it trains from scratch to the end and saves nothing (the reference run).
    Rank 0 shows a progress bar named ``label`` on a terminal."""
    from embckpt import Checkpointer, ResumableSampler
    from embckpt.examples.model import build_model, evaluate, make_batch, train_step

    quiet_known_warnings()
    device = rank_device(rank)
    workload = cfg.workload
    dataset = load_dataset(cfg)
    train_samples = int(len(dataset) * (1 - HOLDOUT_FRACTION))
    holdout = np.arange(train_samples, len(dataset), dtype=np.int64)
    sampler = ResumableSampler(
        train_samples, workload.batch_size, rank=rank, world_size=world_size, seed=workload.seed
    )
    model, optimizer = build_model(workload, device, world_size)
    ckpt = (
        Checkpointer(
            model, out, optimizer=optimizer, config=cfg.checkpoint, statefuls={"data": sampler}
        )
        if out
        else None
    )
    restored = ckpt.restore() if ckpt else None
    losses = []
    started = time.perf_counter()
    bar = _progress_bar(label, restored or 0, cfg.steps) if rank == 0 else None
    for step in range((restored or 0) + 1, cfg.steps + 1):
        losses.append(
            train_step(model, optimizer, make_batch(dataset, next(sampler), workload, device))
        )
        if ckpt and step % cfg.checkpoint_every == 0:
            ckpt.save(step).wait()
            if bar is not None:
                bar.set_postfix_str(f"saved step {step}", refresh=False)
        if bar is not None:
            bar.update()
        if step == kill_at:
            if bar is not None:
                bar.close()  # ends the bar's line: the process dies without clean-up
            os.kill(os.getpid(), signal.SIGKILL)
    if bar is not None:
        bar.close()
    if ckpt:
        ckpt.close()
    metrics = evaluate(model, dataset, holdout, workload, device)
    return {
        "restored_from": restored,
        "steps_run": len(losses),
        "seconds": time.perf_counter() - started,
        "final_loss": float(np.mean(losses[-10:])) if losses else None,
        **metrics,
    }


def _progress_bar(label: str, done: int, steps: int) -> Any:
    """A bar of training steps on stderr, shown on a terminal only (tqdm's ``disable=None``),
    starting at the restored step."""
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore, which the demo's SIGKILL would leave
    # registered (a "leaked semaphore" warning at exit): one bar needs a thread lock only.
    tqdm.set_lock(threading.RLock())
    return tqdm(
        total=steps, initial=done, desc=label, unit="step", disable=None, dynamic_ncols=True
    )


def _prepare_out(out: Path) -> None:
    """Empties an earlier demo's checkpoints and report; refuses a folder holding anything else."""
    if not out.exists():
        return
    ours = {*REPORT_FILES, HEADLINE_DIR}
    foreign = [
        p.name for p in out.iterdir() if not p.name.startswith("step_") and p.name not in ours
    ]
    if foreign:
        raise SystemExit(
            f"{out} holds files that are not demo checkpoints ({foreign[:3]}): "
            "pass an empty or new --out"
        )
    shutil.rmtree(out)


def kill_steps(cfg: DemoConfig, kill_at: list[int] | None, failures: int | None) -> list[int]:
    """Where the workers die: the given steps, ``failures`` random steps between checkpoints,
    or by default once, halfway between the last two checkpoints before two thirds of the run."""
    every = cfg.checkpoint_every
    if kill_at:
        return sorted(set(kill_at))
    candidates = [s for s in range(every + 1, cfg.steps) if s % every]
    if failures:
        rng = random.Random(cfg.workload.seed)
        return sorted(rng.sample(candidates, min(failures, len(candidates))))
    checkpoints = list(range(every, cfg.steps + 1, every))
    before = [c for c in checkpoints if c <= cfg.steps * 2 // 3] or checkpoints[:1]
    return [before[-1] + max(1, every // 2)]


def packaged_config() -> Path:
    """The demo's own settings, shipped inside the package (``embckpt/examples/demo.yaml``):
    what ``embckpt demo`` runs without ``--config``. ``configs/demo.yaml`` in the repository
    is its editable copy, which ``make demo`` runs (a test keeps the two equal)."""
    return Path(__file__).with_name("demo.yaml")


def run_demo(
    config_path: str | None,
    out: str,
    steps: int | None = None,
    world_size: int | None = None,
    kill_at: list[int] | None = None,
    failures: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> int:
    """Runs the whole demo and prints its report; returns the process exit code (1: a
    checkpoint failed to verify, or a worker failed; its traceback is printed on stderr).

    ``overrides`` replaces fields of the config's ``checkpoint`` section (policy, codec, bits).
    The headline setting runs second unless the configured run already uses it.
    """
    started = time.perf_counter()
    cfg = load_yaml(config_path or packaged_config(), DemoConfig)
    cfg = dataclasses.replace(
        cfg,
        steps=steps or cfg.steps,
        world_size=world_size or cfg.world_size,
        checkpoint=dataclasses.replace(cfg.checkpoint, **(overrides or {})),
    )
    every = cfg.checkpoint_every
    if cfg.steps < 2 * every:
        raise SystemExit(f"--steps {cfg.steps} leaves fewer than 2 checkpoints (every {every})")
    kills = kill_steps(cfg, kill_at, failures)
    out_path = Path(out)
    _prepare_out(out_path)
    workload = cfg.workload
    data = f"data {workload.data_path}" if workload.data_path else f"Zipf {workload.zipf_alpha} ids"
    print(
        f"embckpt demo: DLRM with {len(workload.cardinalities)} tables, "
        f"{sum(workload.cardinalities):,} rows of {workload.embedding_dim} columns "
        f"(largest {max(workload.cardinalities):,}), {data}; "
        f"{cfg.world_size} ranks, {cfg.steps} steps, a checkpoint every {every}; "
        f"checkpoints in {out_path}"
    )
    print(f"workers will be killed (SIGKILL) at steps {kills}, restarted and restored each time")
    headline = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **HEADLINE))
    settings = [(cfg, out_path)]
    if headline.checkpoint != cfg.checkpoint:
        settings.append((headline, out_path / HEADLINE_DIR))
    runs, checks = [], []
    try:
        for number, (setting_cfg, folder) in enumerate(settings):
            if number:
                name = _setting(setting_cfg.checkpoint)
                print(
                    f"\nthe same run with the headline setting ({name}), killed at the same "
                    f"steps; checkpoints in {folder}"
                )
            else:
                print(f"\n{_setting(cfg.checkpoint)}: checkpoints in {folder}")
            runs.append(_run_killed(setting_cfg, folder, kills))
            checks.append(verify(CheckpointStore(folder)))
            print(
                f"verify: {'OK' if checks[-1].ok else 'FAILED'} ({len(checks[-1].checked)} "
                f"checkpoints, {checks[-1].files_checked} files)"
            )
        print("\nthe uninterrupted run: same data and seed, no failure, no checkpoint")
        reference = run_ranks(
            train_worker, cfg.world_size, cfg, None, None, "uninterrupted, no checkpoint"
        )[0]
    except (DemoFailed, RankFailed) as exc:
        print(f"embckpt demo failed: {exc}", file=sys.stderr)
        return 1
    print(f"holdout AUC {reference['auc']:.4f}, log loss {reference['logloss']:.4f}")
    print()
    for line in _side_by_side(runs, reference, kills):
        print(line)
    print(f"\ndemo done in {time.perf_counter() - started:.0f}s")
    for line in _where_next(runs[-1]["out"]):
        print(line)
    return 0 if all(check.ok for check in checks) else 1


def _where_next(folder: Path) -> list[str]:
    """The closing lines: where each finding of the demo can be looked at again."""
    return [
        "where to look next:",
        f"  embckpt report {folder}     every checkpoint's bytes, kind and why "
        f"(picture: {folder / REPORT_FILES[0]}, page: {folder / REPORT_FILES[1]})",
        f"  embckpt inspect {folder}    the chain, tables and shards of each checkpoint",
        '  README.md, section "What the demo shows": how to read this table, and how to use '
        "embckpt in your own job",
    ]


def _setting(config: CheckpointConfig) -> str:
    """``one_shot, raw`` or ``intermittent, adaptive 4-bit``: policy and codec in words."""
    bits = f" {config.bits}-bit" if config.bits and config.codec != "raw" else ""
    return f"{config.policy}, {config.codec}{bits}"


def _run_killed(cfg: DemoConfig, out: Path, kills: list[int]) -> dict[str, Any]:
    """Trains with checkpoints in ``out``, SIGKILLing every worker at each step of ``kills``
    and restoring in fresh processes; returns rank 0's results and the directory's report.

    A phase must end the way it was meant to: its workers killed at its step (the launcher
    sees every rank die by a signal), or the run finished. A worker that raised stops the demo
    with its traceback: an error is never taken for the planned kill."""
    store = CheckpointStore(out)
    results: list[dict] = []
    setting = _setting(cfg.checkpoint)
    for phase, kill in enumerate([*kills, None], start=1):
        label = f"{setting}: phase {phase}" + (f", killed at {kill}" if kill else "")
        try:
            results = run_ranks(train_worker, cfg.world_size, cfg, str(out), kill, label)
        except RankFailed as exc:
            if kill is None or not str(exc).startswith("ranks died"):
                raise DemoFailed(f"{setting}, phase {phase}: a worker failed\n{exc}") from exc
            print(
                f"phase {phase}: workers died at step {kill} ({str(exc).splitlines()[0]}); "
                f"committed checkpoints: {store.committed_steps()}"
            )
            continue
        if kill is not None:
            print(f"phase {phase}: the run ended before step {kill}")
            break
    first = results[0]
    print(
        f"last phase restored step {first['restored_from']} on every rank: "
        f"{[r['restored_from'] for r in results]}; ran {first['steps_run']} more steps "
        f"in {first['seconds']:.1f}s; holdout AUC {first['auc']:.4f}, "
        f"log loss {first['logloss']:.4f}"
    )
    report = build_report(store, progress=False)
    png = render_png(report)
    (out / REPORT_FILES[0]).write_bytes(png)
    write_html(report, png, out / REPORT_FILES[1])
    for line in _checkpoint_lines(report):
        print(line)
    print(f"report: {out / REPORT_FILES[0]} (picture), {out / REPORT_FILES[1]} (page)")
    return {"setting": setting, "result": first, "report": report, "out": out}


def _checkpoint_lines(report: dict[str, Any]) -> list[str]:
    """Each checkpoint of a run in one line: kind, what it builds on, the rows it holds and
    their share of all rows (``dirty``), and its bytes against a full fp32 checkpoint (the
    first section of ``embckpt report``)."""
    lines = [f"{'step':>6} {'kind':<5} {'parent':>6} {'rows':>9} {'dirty':>7} {'bytes':>9} vs fp32"]
    for row in report["checkpoints"]:
        parent = "-" if row["parent_step"] is None else str(row["parent_step"])
        ratio = row["ratio_vs_full_fp32"]
        lines.append(
            f"{row['step']:>6} {row['kind']:<5} {parent:>6} {row['rows']:>9,} "
            f"{(row['dirty_fraction'] or 0) * 100:>6.1f}% {format_bytes(row['bytes']):>9} "
            f"{'-' if ratio is None else f'{ratio:.1f}x'}"
        )
    return lines


class DemoFailed(RuntimeError):
    """A demo worker raised instead of dying where the demo kills it."""


def _side_by_side(runs: list[dict[str, Any]], reference: dict, kills: list[int]) -> list[str]:
    """The demo's last lines: each setting's full checkpoints among all, its bytes against full
    fp32 checkpoints (the same files in fp32, as the report counts them; the ratio is the
    report's, measured on the files written) and its final AUC against the uninterrupted run."""
    lines = [
        f"side by side: killed at steps {kills} and restored, against full fp32 checkpoints "
        "and the uninterrupted run",
        f"{'setting':<30} {'fulls':>7} {'written':>9} {'full fp32':>9} {'less':>7} {'AUC':>7}  "
        "vs uninterrupted",
    ]
    for run in runs:
        totals, auc = run["report"]["totals"], run["result"]["auc"]
        delta = (
            "identical" if auc == reference["auc"] else f"{(auc - reference['auc']) * 100:+.2f} pp"
        )
        fulls = f"{totals['full_checkpoints']} of {totals['checkpoints']}"
        lines.append(
            f"{run['setting']:<30} {fulls:>7} {format_bytes(totals['bytes_written']):>9} "
            f"{format_bytes(totals['full_fp32_bytes_written']):>9} "
            f"{totals['ratio_vs_full_fp32'] or 0:>6.2f}x {auc:>7.4f}  {delta}"
        )
    lines.append(
        f"{'uninterrupted, no checkpoint':<30} {'-':>7} {'-':>9} {'-':>9} {'-':>7} "
        f"{reference['auc']:>7.4f}"
    )
    return lines
