"""Merging a checkpoint chain: exactness and bytes, per codec.

For each codec (and entropy stage), 2 gloo ranks train the small workload of
``configs/bench_small.yaml`` (26 Criteo-shaped tables, one of every sharding type, row-wise
Adagrad) and write an incremental chain: a full checkpoint, then ``--diffs`` diffs, one every
``--every`` steps. Both ranks restore the chain head and copy every value they restored
(weights, row-wise and element-wise optimizer states, dense state); rank 0 merges the head
(``embckpt.read.merge.merge``); both restore the merged step and compare. Reports per codec:
the chain's length, the largest absolute difference between the two restores over all those
values (``largest_difference``; 0 means bit-identical), the bytes of the chain's files (every
file of every checkpoint of the chain) and of the merged checkpoint, and the merge's wall
time; beside them ``chain_vs_trained``, the largest difference between the trained state and
its restore (the codec's own loss, which merging must not add to; it shows the comparison can
see a difference). Writes ``benchmarks/results/merge.json``.

Run: ``.venv/bin/python benchmarks/merge.py [--config configs/bench_small.yaml]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, write_result  # noqa: E402

from embckpt.config import load_yaml  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

# name: codec, bits, entropy (the codec's default where "auto")
CODECS: dict[str, tuple[str, int | None, str]] = {
    "raw": ("raw", None, "auto"),
    "fp16": ("fp16", None, "auto"),
    "bf16": ("bf16", None, "auto"),
    "asymmetric4": ("asymmetric", 4, "auto"),
    "symmetric4": ("symmetric", 4, "auto"),
    "adaptive4-huffman": ("adaptive", 4, "huffman"),
    "adaptive4-zstd": ("adaptive", 4, "zstd"),
    "adaptive4-lz4": ("adaptive", 4, "lz4"),
    "adaptive4-none": ("adaptive", 4, "none"),
    "kmeans4": ("kmeans", 4, "auto"),
    "exponent3": ("exponent", 3, "auto"),
}


def _restored(workload: Any, rank: int) -> dict[str, Any]:
    """Copies of every value a restore wrote on this rank: table blocks, optimizer states,
    dense model and optimizer state."""
    import torch

    from embckpt.sharding import discover

    out: dict[str, Any] = {}
    for shard in discover(workload.model, rank).shards:
        out[f"w:{shard.key}"] = shard.weight.detach().clone()
        for name, value in {**shard.row_states, **shard.elem_states}.items():
            out[f"s:{shard.key}:{name}"] = value.detach().clone()
    for key, value in workload.model.state_dict().items():
        if not hasattr(value, "local_shards"):
            out[f"d:{key}"] = value.detach().clone()
    for pid, state in workload.optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"o:{pid}:{name}"] = torch.as_tensor(value).clone()
    return out


def _largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |a - b| over every value (inf where keys, shapes or NaN positions differ)."""
    import torch

    worst = 0.0
    for key in set(a) | set(b):
        if key not in a or key not in b or a[key].shape != b[key].shape:
            return float("inf")
        x, y = a[key].double(), b[key].double()
        if not torch.equal(torch.isnan(x), torch.isnan(y)):
            return float("inf")
        same = (x == y) | torch.isnan(x)  # equal infinities give NaN differences
        if x.numel() and not bool(same.all()):
            worst = max(worst, float((x - y)[~same].abs().max()))
    return worst


def _worker(
    rank: int, world_size: int, cfg: DemoConfig, root: str, every: int, diffs: int
) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from embckpt import Checkpointer
    from embckpt.examples.demo import load_dataset
    from embckpt.read.merge import merge
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.verify import verify

    dataset = load_dataset(cfg)
    rows = []
    for name, (codec, bits, entropy) in CODECS.items():
        workload = build_workload(rank, world_size, cfg, dataset)
        config = dataclasses.replace(
            cfg.checkpoint,
            policy="incremental",
            full_every=0,
            codec=codec,
            bits=bits,
            entropy=entropy,
        )
        directory = f"{root}/{name}"
        head = every * (diffs + 1)
        with Checkpointer(
            workload.model, directory, optimizer=workload.optimizer, config=config
        ) as ckpt:
            for step in range(1, head + 1):
                workload.step()
                if step % every == 0:
                    ckpt.save(step).wait()
            trained = _restored(workload, rank)
            ckpt.restore(head)
        chain_state = _restored(workload, rank)
        row: dict[str, Any] = {"name": name, "codec": codec, "bits": bits, "entropy": entropy}
        row["chain_vs_trained"] = _largest_difference(trained, chain_state)
        if rank == 0:
            store = CheckpointStore(directory)
            chain = read_chain(store, head)
            row["chain_length"] = len(chain)
            row["bytes_before"] = sum(m.total_bytes for m in chain)
            started = time.perf_counter()
            merged = merge(store, head)
            row["merge_seconds"] = round(time.perf_counter() - started, 3)
            row["bytes_after"] = merged.total_bytes
            row["merged_files"] = len(merged.files)
            row["verify_ok"] = verify(store).ok
        dist.barrier()
        with Checkpointer(
            workload.model, directory, optimizer=workload.optimizer, config=config
        ) as ckpt:
            ckpt.restore(head)
        row["largest_difference"] = _largest_difference(chain_state, _restored(workload, rank))
        row["values_compared"] = sum(v.numel() for v in chain_state.values())
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_small.yaml")
    parser.add_argument("--every", type=int, default=5, help="training steps between saves")
    parser.add_argument("--diffs", type=int, default=4, help="diffs after the full checkpoint")
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        ranks = run_ranks(_worker, cfg.world_size, cfg, root, args.every, args.diffs)
    table = []
    for row, *others in zip(*ranks, strict=True):
        worst = max([row["largest_difference"], *(o["largest_difference"] for o in others)])
        lossy = max([row["chain_vs_trained"], *(o["chain_vs_trained"] for o in others)])
        values = row["values_compared"] + sum(o["values_compared"] for o in others)
        table.append(
            {
                **row,
                "largest_difference": worst,
                "chain_vs_trained": lossy,
                "values_compared": values,
            }
        )
        print(
            f"{row['name']:>18}: chain of {row['chain_length']}, largest difference {worst} "
            f"(chain vs trained {lossy:.3g}), "
            f"{row['bytes_before']:,} -> {row['bytes_after']:,} bytes, "
            f"merge {row['merge_seconds']} s, verify {'ok' if row['verify_ok'] else 'FAILED'}"
        )
    path = write_result(
        "merge",
        {
            "config": args.config,
            "world_size": cfg.world_size,
            "every": args.every,
            "diffs": args.diffs,
            "seconds": round(time.perf_counter() - started, 1),
            "codecs": table,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
