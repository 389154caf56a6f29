"""What restores from quantized checkpoints do to accuracy (Check-N-Run's Figure 14).

For each seed, a failure-free run of the demo workload sets the reference final AUC and log
loss. Then, for each quantizer and bit width, the same run is repeated with 1, 2, 3 and 5
failures spread over training: at each failure the job loses the steps since its last
checkpoint, restores that checkpoint (the quantized rows replace the live ones; optimizer state
is lossless) and trains on through the same data again. Reports final AUC / log loss and their
difference to the failure-free run of the same seed, beside the seed-to-seed spread of the
failure-free runs. The adaptive quantizer runs the whole grid (2, 3, 4, 8 bits x 1, 2, 3, 5
restores); the other quantizers 2 and 4 bits after 1 and 5 restores.
Writes ``benchmarks/results/accuracy.json`` and ``accuracy.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import RESULTS, write_result  # noqa: E402

from embckpt.config import load_yaml
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

HOLDOUT = 0.1
BIT_COLORS = {2: "#1f77b4", 3: "#2ca02c", 4: "#ff7f0e", 8: "#d62728"}


def failure_steps(steps: int, every: int, failures: int) -> list[int]:
    """Failures spread evenly, each halfway into a checkpoint interval."""
    points = []
    for k in range(1, failures + 1):
        at = round(steps * k / (failures + 1))
        points.append(max(every, at - at % every) + every // 2)
    return sorted(set(points))


def _worker(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    root: str,
    steps: int,
    every: int,
    grid: list[tuple[str, int, int]],
    seed: int,
) -> list[dict[str, Any]]:
    import numpy as np

    from embckpt import Checkpointer
    from embckpt.data import ResumableSampler
    from embckpt.examples.demo import load_dataset
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model, evaluate, make_batch, train_step

    device = rank_device(rank)
    workload = dataclasses.replace(cfg.workload, seed=seed)
    dataset = load_dataset(dataclasses.replace(cfg, workload=workload))
    train = int(len(dataset) * (1 - HOLDOUT))
    holdout = np.arange(train, len(dataset), dtype=np.int64)
    out = []
    for index, (codec, bits, failures) in enumerate(grid):
        started = time.perf_counter()
        sampler = ResumableSampler(
            train, workload.batch_size, rank=rank, world_size=world_size, seed=seed
        )
        model, optimizer = build_model(workload, device, world_size)
        config = dataclasses.replace(cfg.checkpoint, codec=codec, bits=bits or None)
        pending = failure_steps(steps, every, failures) if failures else []
        restored_from = []
        with Checkpointer(
            model,
            f"{root}/{seed}-{index}",
            optimizer=optimizer,
            config=config,
            statefuls={"data": sampler},
        ) as ckpt:
            step = 0
            while step < steps:
                step += 1
                train_step(model, optimizer, make_batch(dataset, next(sampler), workload, device))
                if failures and step % every == 0:
                    ckpt.save(step).wait()
                if pending and step == pending[0]:
                    pending.pop(0)
                    step = ckpt.restore() or 0
                    restored_from.append(step)
        metrics = evaluate(model, dataset, holdout, workload, device)
        out.append(
            {
                "codec": codec,
                "bits": bits,
                "failures": failures,
                "seed": seed,
                "restored_from": restored_from,
                **metrics,
                "seconds": time.perf_counter() - started,
            }
        )
    return out


def _plot(rows: list[dict[str, Any]], spread: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = sorted({r["codec"] for r in rows if r["failures"]})
    fig, axes = plt.subplots(
        1, len(codecs), figsize=(4.2 * len(codecs), 4), sharey=True, squeeze=False
    )
    for ax, codec in zip(axes[0], codecs, strict=True):
        for bits in sorted({r["bits"] for r in rows if r["codec"] == codec}):
            points = sorted(
                (r["failures"], r["auc_delta_mean"])
                for r in rows
                if r["codec"] == codec and r["bits"] == bits
            )
            ax.plot(
                [p[0] for p in points],
                [100 * p[1] for p in points],
                marker="o",
                color=BIT_COLORS.get(bits),
                label=f"{bits} bits",
            )
        ax.axhspan(
            -100 * spread,
            100 * spread,
            color="grey",
            alpha=0.2,
            label="seed-to-seed spread (failure-free)",
        )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"{codec} (mean over seeds)")
        ax.set_xlabel("restores during training")
        ax.set_xticks(sorted({r["failures"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel("final AUC minus failure-free AUC\n(percentage points, same seed)")
    fig.suptitle("Accuracy after restores from quantized checkpoints (Check-N-Run Fig. 14)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=15)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--codecs", nargs="+", default=["adaptive", "asymmetric", "symmetric", "kmeans"]
    )
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--failures", type=int, nargs="+", default=[1, 2, 3, 5])
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    # The adaptive quantizer gets the whole grid; the others 2 and 4 bits after 1 and 5
    # restores, which brackets them at a third of the cost.
    grid = [("raw", 0, 0)] + [
        (c, b, f)
        for c in args.codecs
        for b in args.bits
        for f in args.failures
        if c == "adaptive" or (b in (2, 4) and f in (1, 5))
    ]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        for seed in args.seeds:
            ranks = run_ranks(
                _worker,
                cfg.world_size,
                cfg,
                root,
                args.steps,
                args.every,
                grid,
                seed,
                timeout_s=7200,
            )
            rows.extend(ranks[0])
            print(f"seed {seed}: {len(ranks[0])} runs done", flush=True)
    baseline = {r["seed"]: r for r in rows if r["failures"] == 0}
    base_aucs = [r["auc"] for r in baseline.values()]
    spread = statistics.pstdev(base_aucs) if len(base_aucs) > 1 else 0.0
    table = []
    for codec, bits, failures in grid[1:]:
        runs = [
            r for r in rows if (r["codec"], r["bits"], r["failures"]) == (codec, bits, failures)
        ]
        deltas = [r["auc"] - baseline[r["seed"]]["auc"] for r in runs]
        loss_deltas = [r["logloss"] - baseline[r["seed"]]["logloss"] for r in runs]
        table.append(
            {
                "codec": codec,
                "bits": bits,
                "failures": failures,
                "auc_mean": statistics.mean(r["auc"] for r in runs),
                "auc_delta_mean": statistics.mean(deltas),
                "auc_delta_min": min(deltas),
                "logloss_delta_mean": statistics.mean(loss_deltas),
                "within_spread": abs(statistics.mean(deltas)) <= spread,
            }
        )
        print(
            f"{codec:>11} {bits} bits, {failures} restores: AUC {table[-1]['auc_mean']:.4f} "
            f"(delta {100 * table[-1]['auc_delta_mean']:+.3f} pp, worst "
            f"{100 * min(deltas):+.3f} pp), log loss delta {table[-1]['logloss_delta_mean']:+.5f}"
        )
    summary = {
        "failure_free_auc_mean": statistics.mean(base_aucs),
        "failure_free_auc_spread": spread,
        "adaptive_4bit_5_restores_auc_delta": next(
            (
                t["auc_delta_mean"]
                for t in table
                if (t["codec"], t["bits"], t["failures"]) == ("adaptive", 4, 5)
            ),
            None,
        ),
        "adaptive_2bit_3_restores_auc_delta": next(
            (
                t["auc_delta_mean"]
                for t in table
                if (t["codec"], t["bits"], t["failures"]) == ("adaptive", 2, 3)
            ),
            None,
        ),
    }
    _plot(table, spread, RESULTS / "accuracy.png")
    path = write_result(
        "accuracy", {"args": vars(args), "summary": summary, "table": table, "runs": rows}
    )
    print(summary)
    print(f"wrote {path} and {RESULTS / 'accuracy.png'}")


if __name__ == "__main__":
    main()
