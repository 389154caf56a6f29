"""What restores from compressed checkpoints do to accuracy, resolved to 0.05 AUC points.

The workload (``configs/bench_accuracy.yaml``) trains near convergence on a fixed dataset, so
that failure-free runs from different seeds (each seed sets the model's initialisation and the
data order, not the data) end close together. For each seed:

* the failure-free run sets the reference holdout AUC and log loss (the first seed's runs twice:
  training is deterministic, so the repeat must score exactly the same);
* each variant (the config's checkpoint setting with lossless or ``log8`` optimizer state) runs
  the same seed, initialisation and data order with 1 or 5 failures: at each failure the job
  loses the steps since its last checkpoint, restores it and trains on through the same data.

A variant's paired delta is its AUC (log loss) minus the failure-free run's of the same seed;
its standard error comes from a paired Poisson bootstrap over the holdout samples (the same
resamples score both models). Reports, per variant, the deltas beside the failure-free
seed-to-seed spread (max - min over seeds). Writes ``benchmarks/results/accuracy.json`` and
``accuracy.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from common import RESULTS, write_result  # noqa: E402

from embckpt import CheckpointConfig, ConfigError  # noqa: E402
from embckpt.config import load_yaml  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

_TIERS: dict[str, Any] = {
    "optimizer_codec": "raw",
    "local_dir": "local",  # under the run's folder
    "replicas": 1,
    "durable_every": 3,  # a failure 4 checkpoints after a restart finds the newest local only
}
# Checkpoint settings each variant changes in the config's checkpoint section.
VARIANTS: dict[str, dict[str, Any]] = {
    "optimizer_raw": {"optimizer_codec": "raw"},
    "optimizer_log8": {"optimizer_codec": "log8"},
    # Control: every byte lossless, so restores must change nothing (delta exactly 0).
    "lossless": {"codec": "raw", "bits": None, "optimizer_codec": "raw"},
    # The node-local tier, each rank its own node; every failure loses node n1 and n0's replica
    # of it: partial recovery (n1's blocks from the newest older step holding them) against the
    # full restore of the newest step every node can restore whole (the durable one).
    "partial_recovery": {**_TIERS, "partial_recovery": True},
    "node_lost_full": _TIERS,
}
FAILURE_FREE = "failure_free"
REPEAT = "failure_free_repeat"
RESOLUTION_TARGET_PP = 0.05
VARIANT_COLORS = {
    "optimizer_raw": "#1f77b4",
    "optimizer_log8": "#ff7f0e",
    "lossless": "#2ca02c",
    "partial_recovery": "#d62728",
    "node_lost_full": "#9467bd",
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a seed: a name, its checkpoint setting (None: no checkpoints) and
    how many failures it restores from."""

    name: str
    checkpoint: CheckpointConfig | None
    failures: int


def failure_steps(steps: int, every: int, failures: int) -> list[int]:
    """Failures spread evenly, each halfway into a checkpoint interval."""
    points = []
    for k in range(1, failures + 1):
        at = round(steps * k / (failures + 1))
        points.append(max(every, at - at % every) + every // 2)
    return sorted(set(points))


def available_variants(base: CheckpointConfig, names: list[str]) -> dict[str, CheckpointConfig]:
    """The named variants' checkpoint settings; a variant whose codec is not registered in this
    version (e.g. ``log8`` before it lands) is skipped with a printed note."""
    out = {}
    for name in names:
        try:
            out[name] = dataclasses.replace(base, **VARIANTS[name])
        except (ConfigError, ValueError) as exc:
            print(f"note: variant {name} skipped, this version cannot build it: {exc}")
    return out


def _holdout_logits(model: Any, dataset: Any, holdout: np.ndarray, workload: Any) -> np.ndarray:
    """The model's logits on the holdout (collective: every rank scores the same batches)."""
    import torch

    from embckpt.examples.model import make_batch

    model.eval()
    chunks = []
    with torch.no_grad():
        for start in range(0, len(holdout), 8192):
            dense, sparse, _ = make_batch(
                dataset, holdout[start : start + 8192], workload, torch.device("cpu")
            )
            chunks.append(model(dense, sparse).squeeze(-1).float().numpy())
    return np.concatenate(chunks)


def _worker(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    root: str,
    holdout_size: int,
    runs: list[Run],
    seed: int,
) -> list[dict[str, Any]]:
    from embckpt import Checkpointer
    from embckpt.data import ResumableSampler
    from embckpt.examples.demo import load_dataset, quiet_known_warnings
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model, make_batch, train_step

    quiet_known_warnings()
    device = rank_device(rank)
    workload = cfg.workload
    dataset = load_dataset(cfg)  # the config's data seed: every run seed sees the same data
    train = len(dataset) - holdout_size
    holdout = np.arange(train, len(dataset), dtype=np.int64)
    seeded = dataclasses.replace(workload, seed=seed)  # the run seed: initialisation
    every = cfg.checkpoint_every
    out = []
    for index, run in enumerate(runs):
        started = time.perf_counter()
        sampler = ResumableSampler(
            train, workload.batch_size, rank=rank, world_size=world_size, seed=seed
        )
        model, optimizer = build_model(seeded, device, world_size)
        pending = failure_steps(cfg.steps, every, run.failures) if run.checkpoint else []
        restored_from = []
        config = run.checkpoint
        if config is not None and config.local_dir is not None:
            os.environ["EMBCKPT_NODE"] = f"n{rank}"
            config = dataclasses.replace(config, local_dir=f"{root}/{seed}-{index}-local")

        open_checkpointer = functools.partial(
            Checkpointer,
            model,
            f"{root}/{seed}-{index}",
            optimizer=optimizer,
            config=config,
            statefuls={"data": sampler},
        )
        ckpt = open_checkpointer() if config else None
        step = 0
        while step < cfg.steps:
            step += 1
            train_step(model, optimizer, make_batch(dataset, next(sampler), workload, device))
            if ckpt and step % every == 0:
                ckpt.save(step).wait()
            if ckpt and pending and step == pending[0]:
                pending.pop(0)
                if config is not None and config.local_dir is not None:
                    ckpt.close()
                    _lose_node(config.local_dir, rank)
                    ckpt = open_checkpointer()
                # The node lost took the newest step's only whole copy: drop what is left of it.
                lost = config is not None and config.local_dir is not None
                step = ckpt.restore(discard_newer=lost) or 0
                restored_from.append(step)
        if ckpt:
            ckpt.close()
        logits = _holdout_logits(model, dataset, holdout, workload)
        out.append(
            {
                "name": run.name,
                "failures": run.failures,
                "seed": seed,
                "restored_from": restored_from,
                "seconds": time.perf_counter() - started,
                "logits": logits if rank == 0 else None,
                "labels": dataset.labels[holdout] if rank == 0 and index == 0 else None,
            }
        )
    return out


def _lose_node(local_dir: str, rank: int) -> None:
    """Node n1's folder and n0's replica of it gone, as the relaunch finds them."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(local_dir, "n1"), ignore_errors=True)
        shutil.rmtree(Path(local_dir, "n0", "replicas", "n1"), ignore_errors=True)
    dist.barrier()


def weighted_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """ROC AUC of ``scores`` under each row of sample ``weights`` ``[B, N]`` (Mann-Whitney;
    tied scores count half), all rows at once."""
    order = np.argsort(scores, kind="stable")
    ranked = scores[order]
    positive = labels[order] > 0.5
    w = weights[:, order]
    new_group = np.r_[True, ranked[1:] != ranked[:-1]]
    group = np.cumsum(new_group) - 1
    negative_w = w * ~positive
    per_group = np.add.reduceat(negative_w, np.flatnonzero(new_group), axis=1)
    # Negatives scored below each group, plus half of those tied with it.
    credit = np.cumsum(per_group, axis=1) - 0.5 * per_group
    positive_w = w * positive
    pairs = positive_w.sum(axis=1) * negative_w.sum(axis=1)
    return (positive_w * credit[:, group]).sum(axis=1) / pairs


def log_loss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of ``logits`` against ``labels``."""
    return float(np.mean(np.logaddexp(logits, 0.0) - labels * logits))


def paired_bootstrap(
    base: np.ndarray, others: list[np.ndarray], labels: np.ndarray, resamples: int, seed: int
) -> list[np.ndarray]:
    """AUC of each of ``others`` minus ``base``'s, over the same Poisson resamples of the
    holdout for all models (so the noise both share cancels); one array per model."""
    rng = np.random.default_rng(seed)
    deltas: list[list[np.ndarray]] = [[] for _ in others]
    for start in range(0, resamples, 16):  # 16 resamples at a time bound the memory
        weights = rng.poisson(1.0, (min(16, resamples - start), len(labels))).astype(np.float64)
        reference = weighted_auc(base, labels, weights)
        for out, logits in zip(deltas, others, strict=True):
            out.append(weighted_auc(logits, labels, weights) - reference)
    return [np.concatenate(d) for d in deltas]


def summarise(rows: list[dict[str, Any]], labels: np.ndarray, resamples: int) -> dict[str, Any]:
    """Failure-free spread, determinism and each variant's paired deltas (see module doc)."""
    ones = np.ones((1, len(labels)))
    for row in rows:
        row["auc"] = float(weighted_auc(row["logits"], labels, ones)[0])
        row["logloss"] = log_loss(row["logits"], labels)
    base = {r["seed"]: r for r in rows if r["name"] == FAILURE_FREE}
    base_aucs = [r["auc"] for r in base.values()]
    spread = max(base_aucs) - min(base_aucs)
    repeats = [(base[r["seed"]], r) for r in rows if r["name"] == REPEAT]
    variant_rows = [r for r in rows if r["name"] not in (FAILURE_FREE, REPEAT)]
    for seed, reference in base.items():
        mine = [r for r in variant_rows if r["seed"] == seed]
        boot = paired_bootstrap(
            reference["logits"], [r["logits"] for r in mine], labels, resamples, seed
        )
        for row, deltas in zip(mine, boot, strict=True):
            row["auc_delta"] = row["auc"] - reference["auc"]
            row["auc_delta_se"] = float(np.std(deltas, ddof=1))
            row["logloss_delta"] = row["logloss"] - reference["logloss"]
    table = []
    for name, failures in dict.fromkeys((r["name"], r["failures"]) for r in variant_rows):
        runs = [r for r in variant_rows if (r["name"], r["failures"]) == (name, failures)]
        seed_deltas = [r["auc_delta"] for r in runs]
        mean = statistics.mean(seed_deltas)
        table.append(
            {
                "variant": name,
                "failures": failures,
                "seeds": len(runs),
                "auc_mean": statistics.mean(r["auc"] for r in runs),
                "auc_delta_mean": mean,
                "auc_delta_min": min(seed_deltas),
                "auc_delta_max": max(seed_deltas),
                # Of the mean over seeds: the per-seed bootstrap errors are independent.
                "auc_delta_se": float(np.sqrt(sum(r["auc_delta_se"] ** 2 for r in runs)))
                / len(runs),
                "logloss_delta_mean": statistics.mean(r["logloss_delta"] for r in runs),
                "logloss_delta_min": min(r["logloss_delta"] for r in runs),
                "logloss_delta_max": max(r["logloss_delta"] for r in runs),
                "within_spread": abs(mean) <= spread,
            }
        )
    resolution = max((r["auc_delta_se"] for r in variant_rows), default=float("nan"))
    return {
        "failure_free_auc_mean": statistics.mean(base_aucs),
        "failure_free_auc_spread_pp": 100 * spread,
        "failure_free_auc_stdev_pp": 100 * statistics.stdev(base_aucs)
        if len(base_aucs) > 1
        else 0.0,
        "repeat_auc_delta_pp": [100 * (r["auc"] - b["auc"]) for b, r in repeats],
        "repeat_logits_identical": all(
            np.array_equal(b["logits"], r["logits"]) for b, r in repeats
        ),
        "paired_resolution_pp": 100 * resolution,
        "resolves_target": bool(100 * resolution <= RESOLUTION_TARGET_PP),
        "variants": {
            f"{t['variant']}_{t['failures']}_restores": {
                "auc_delta_pp": 100 * t["auc_delta_mean"],
                "auc_delta_min_pp": 100 * t["auc_delta_min"],
                "auc_delta_max_pp": 100 * t["auc_delta_max"],
                "auc_delta_se_pp": 100 * t["auc_delta_se"],
                "logloss_delta": t["logloss_delta_mean"],
                "within_spread": t["within_spread"],
            }
            for t in table
        },
        "table": table,
    }


def _plot(rows: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summary["table"]
    spread = summary["failure_free_auc_spread_pp"]
    fig, ax = plt.subplots(figsize=(1.6 * len(table) + 3, 4.2))
    for x, t in enumerate(table):
        color = VARIANT_COLORS.get(t["variant"], "grey")
        seeds = [
            100 * r["auc_delta"]
            for r in rows
            if (r["name"], r["failures"]) == (t["variant"], t["failures"])
        ]
        ax.scatter([x] * len(seeds), seeds, color=color, alpha=0.5, s=18)
        ax.errorbar(
            x,
            100 * t["auc_delta_mean"],
            yerr=2 * 100 * t["auc_delta_se"],
            fmt="D",
            color=color,
            capsize=4,
        )
    ax.axhspan(-spread, spread, color="grey", alpha=0.2, label="failure-free seed spread")
    for sign in (-1, 1):
        ax.axhline(
            sign * RESOLUTION_TARGET_PP,
            color="black",
            ls=":",
            lw=0.8,
            label="0.05 pp" if sign > 0 else None,
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(table)))
    ax.set_xticklabels([f"{t['variant']}\n{t['failures']} restores" for t in table], fontsize=8)
    ax.set_ylabel("AUC minus failure-free AUC, same seed (pp)\nseeds (dots), mean +- 2 SE")
    ax.set_title(
        f"Restores from checkpoints: paired AUC deltas (resolution "
        f"{summary['paired_resolution_pp']:.3f} pp, spread {spread:.3f} pp)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_accuracy.yaml")
    parser.add_argument("--holdout", type=int, default=300_000, help="last samples held out")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=sorted(VARIANTS),
        default=["optimizer_raw", "optimizer_log8"],
    )
    parser.add_argument("--failures", type=int, nargs="+", default=[5])
    parser.add_argument("--bootstrap", type=int, default=200, help="paired bootstrap resamples")
    parser.add_argument("--name", default="accuracy", help="results/<name>.json and .png")
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    variants = available_variants(cfg.checkpoint, args.variants)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    labels = np.empty(0)
    with tempfile.TemporaryDirectory() as root:
        for seed in args.seeds:
            runs = [Run(FAILURE_FREE, None, 0)]
            runs += [Run(REPEAT, None, 0)] if seed == args.seeds[0] else []
            runs += [Run(n, c, f) for n, c in variants.items() for f in args.failures]
            ranks = run_ranks(
                _worker, cfg.world_size, cfg, root, args.holdout, runs, seed, timeout_s=7200
            )
            labels = ranks[0][0]["labels"]
            rows.extend(ranks[0])
            print(
                f"seed {seed}: {len(runs)} runs in {time.perf_counter() - started:.0f}s",
                flush=True,
            )
    summary = summarise(rows, labels, args.bootstrap)
    for t in summary["table"]:
        print(
            f"{t['variant']:>15}, {t['failures']} restores: AUC delta "
            f"{100 * t['auc_delta_mean']:+.3f} pp (seeds {100 * t['auc_delta_min']:+.3f} .. "
            f"{100 * t['auc_delta_max']:+.3f}, SE {100 * t['auc_delta_se']:.3f}), log loss "
            f"delta {t['logloss_delta_mean']:+.5f}, within spread: {t['within_spread']}"
        )
    seconds = time.perf_counter() - started
    for row in rows:
        del row["logits"], row["labels"]
    png = RESULTS / f"{args.name}.png"
    _plot(rows, summary, png)
    path = write_result(
        args.name,
        {
            "args": vars(args),
            "config": dataclasses.asdict(cfg),
            "summary": {k: v for k, v in summary.items() if k != "table"},
            "table": summary["table"],
            "runs": rows,
            "seconds": seconds,
        },
    )
    print({k: v for k, v in summary.items() if k != "table"})
    print(f"{seconds:.0f}s; wrote {path} and {png}")


if __name__ == "__main__":
    main()
