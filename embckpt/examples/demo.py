"""The demo: train the reference DLRM on N ranks with checkpoints, kill every worker between two
checkpoints, start new workers that restore and finish, then report what checkpoints cost.

This is the failure a checkpointer exists for, done for real: the first workers die by SIGKILL
(no clean-up runs), and the second set of processes knows nothing but the checkpoint directory.

The configured run (``configs/demo.yaml``: lossless one-shot diffs) is followed by the same run,
killed at the same steps, with the setting the project is for (``HEADLINE``: the intermittent
policy and adaptive 4-bit rows), and by one uninterrupted run without checkpoints. The demo ends
with both settings side by side: bytes against full fp32 checkpoints, and final AUC against the
uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from embckpt import CheckpointConfig, CheckpointStore, load_yaml, verify
from embckpt.examples.launcher import RankFailed, rank_device, run_ranks
from embckpt.examples.workload import DemoConfig
from embckpt.report import build_report, format_bytes, format_table, render_png, write_html

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
    rank: int, world_size: int, cfg: DemoConfig, out: str | None, kill_at: int | None
) -> dict:
    """One rank of the demo: restore if there is a checkpoint, train, checkpoint, maybe die.
    Without ``out`` it trains from scratch to the end and saves nothing (the reference run)."""
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
    for step in range((restored or 0) + 1, cfg.steps + 1):
        losses.append(
            train_step(model, optimizer, make_batch(dataset, next(sampler), workload, device))
        )
        if ckpt and step % cfg.checkpoint_every == 0:
            ckpt.save(step).wait()
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
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


def run_demo(
    config_path: str | None,
    out: str,
    steps: int | None = None,
    world_size: int | None = None,
    kill_at: list[int] | None = None,
    failures: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> int:
    """Runs the whole demo and prints its report; returns the process exit code.

    ``overrides`` replaces fields of the config's ``checkpoint`` section (policy, codec, bits).
    The headline setting runs second unless the configured run already uses it.
    """
    cfg = load_yaml(config_path, DemoConfig) if config_path else DemoConfig()
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
    print(
        f"embckpt demo: {cfg.world_size} ranks, {cfg.steps} steps, checkpoint every {every} "
        f"({cfg.checkpoint.policy}, full every {cfg.checkpoint.full_every}, codec "
        f"{cfg.checkpoint.codec}), checkpoints in {out_path}"
    )
    print(f"workers will be killed (SIGKILL) at steps {kills}, restarted and restored each time")
    runs = [_run_killed(cfg, out_path, kills)]
    summary = runs[0]["report"]
    print()
    print(format_table(summary))
    print(f"figures: {out_path / REPORT_FILES[0]}, page: {out_path / REPORT_FILES[1]}")
    checks = [verify(CheckpointStore(out_path))]
    print(
        f"verify: {'OK' if checks[0].ok else 'FAILED'} ({len(checks[0].checked)} checkpoints, "
        f"{checks[0].files_checked} files)"
    )

    headline = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **HEADLINE))
    if headline.checkpoint != cfg.checkpoint:
        print(
            f"\nthe same run with the headline setting ({_setting(headline.checkpoint)}), "
            f"killed at the same steps; checkpoints in {out_path / HEADLINE_DIR}"
        )
        runs.append(_run_killed(headline, out_path / HEADLINE_DIR, kills))
        checks.append(verify(CheckpointStore(out_path / HEADLINE_DIR)))
        print(
            f"verify: {'OK' if checks[1].ok else 'FAILED'} ({len(checks[1].checked)} "
            f"checkpoints, {checks[1].files_checked} files)"
        )
    print("\nthe uninterrupted run: same data and seed, no failure, no checkpoint")
    reference = run_ranks(train_worker, cfg.world_size, cfg, None, None)[0]
    print(f"holdout AUC {reference['auc']:.4f}, log loss {reference['logloss']:.4f}")
    print()
    for line in _side_by_side(runs, reference, kills):
        print(line)
    return 0 if all(check.ok for check in checks) else 1


def _setting(config: CheckpointConfig) -> str:
    """``one_shot, raw`` or ``intermittent, adaptive 4-bit``: policy and codec in words."""
    bits = f" {config.bits}-bit" if config.bits and config.codec != "raw" else ""
    return f"{config.policy}, {config.codec}{bits}"


def _run_killed(cfg: DemoConfig, out: Path, kills: list[int]) -> dict[str, Any]:
    """Trains with checkpoints in ``out``, SIGKILLing every worker at each step of ``kills``
    and restoring in fresh processes; returns rank 0's results and the directory's report."""
    store = CheckpointStore(out)
    results: list[dict] = []
    for phase, kill in enumerate([*kills, None], start=1):
        try:
            results = run_ranks(train_worker, cfg.world_size, cfg, str(out), kill)
        except RankFailed as exc:
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
    return {"setting": _setting(cfg.checkpoint), "result": first, "report": report}


def _side_by_side(runs: list[dict[str, Any]], reference: dict, kills: list[int]) -> list[str]:
    """The demo's last lines: each setting's bytes against full fp32 checkpoints (the same
    files in fp32, as the report counts them) and its final AUC against the uninterrupted run."""
    lines = [
        f"side by side: killed at steps {kills} and restored, against full fp32 checkpoints "
        "and the uninterrupted run",
        f"{'setting':<30} {'written':>9} {'full fp32':>9} {'less':>7} {'AUC':>7}  vs uninterrupted",
    ]
    for run in runs:
        totals, auc = run["report"]["totals"], run["result"]["auc"]
        delta = (
            "identical" if auc == reference["auc"] else f"{(auc - reference['auc']) * 100:+.2f} pp"
        )
        lines.append(
            f"{run['setting']:<30} {format_bytes(totals['bytes_written']):>9} "
            f"{format_bytes(totals['full_fp32_bytes_written']):>9} "
            f"{totals['ratio_vs_full_fp32'] or 0:>6.2f}x {auc:>7.4f}  {delta}"
        )
    lines.append(
        f"{'uninterrupted, no checkpoint':<30} {'-':>9} {'-':>9} {'-':>7} {reference['auc']:>7.4f}"
    )
    return lines
