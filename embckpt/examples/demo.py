"""The demo: train the reference DLRM on N ranks with checkpoints, kill every worker between two
checkpoints, start new workers that restore and finish, then report what checkpoints cost.

This is the failure a checkpointer exists for, done for real: the first workers die by SIGKILL
(no clean-up runs), and the second set of processes knows nothing but the checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from embckpt import CheckpointStore, load_yaml, verify
from embckpt.examples.launcher import RankFailed, rank_device, run_ranks
from embckpt.examples.workload import DemoConfig
from embckpt.report import build_report, format_table, render_png, write_html

HOLDOUT_FRACTION = 0.1
REPORT_FILES = ("report.png", "report.html")  # written next to the checkpoints


def load_dataset(cfg: DemoConfig) -> Any:
    """The workload's data: Criteo TSV when ``data_path`` is set, else the synthetic log."""
    from embckpt.examples.criteo import load_criteo_tsv
    from embckpt.examples.synthetic import make_synthetic_dataset

    workload = cfg.workload
    if workload.data_path:
        return load_criteo_tsv(workload.data_path, workload, max_rows=workload.num_samples)
    return make_synthetic_dataset(workload)


def train_worker(
    rank: int, world_size: int, cfg: DemoConfig, out: str, kill_at: int | None
) -> dict:
    """One rank of the demo: restore if there is a checkpoint, train, checkpoint, maybe die."""
    from embckpt import Checkpointer, ResumableSampler
    from embckpt.examples.model import build_model, evaluate, make_batch, train_step

    device = rank_device(rank)
    workload = cfg.workload
    dataset = load_dataset(cfg)
    train_samples = int(len(dataset) * (1 - HOLDOUT_FRACTION))
    holdout = np.arange(train_samples, len(dataset), dtype=np.int64)
    sampler = ResumableSampler(
        train_samples, workload.batch_size, rank=rank, world_size=world_size, seed=workload.seed
    )
    model, optimizer = build_model(workload, device, world_size)
    ckpt = Checkpointer(
        model, out, optimizer=optimizer, config=cfg.checkpoint, statefuls={"data": sampler}
    )
    restored = ckpt.restore()
    losses = []
    started = time.perf_counter()
    for step in range((restored or 0) + 1, cfg.steps + 1):
        losses.append(
            train_step(model, optimizer, make_batch(dataset, next(sampler), workload, device))
        )
        if step % cfg.checkpoint_every == 0:
            ckpt.save(step).wait()
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
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
    ours = set(REPORT_FILES)
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
    store = CheckpointStore(out_path)
    results: list[dict] = []
    for phase, kill in enumerate([*kills, None], start=1):
        try:
            results = run_ranks(train_worker, cfg.world_size, cfg, str(out_path), kill)
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
    print()
    summary = build_report(store, progress=False)
    print(format_table(summary))
    png = render_png(summary)
    (out_path / REPORT_FILES[0]).write_bytes(png)
    write_html(summary, png, out_path / REPORT_FILES[1])
    print(f"figures: {out_path / REPORT_FILES[0]}, page: {out_path / REPORT_FILES[1]}")
    report = verify(store)
    print(
        f"verify: {'OK' if report.ok else 'FAILED'} ({len(report.checked)} checkpoints, "
        f"{report.files_checked} files)"
    )
    return 0 if report.ok else 1
