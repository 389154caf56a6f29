"""What a checkpoint costs the training loop: save() blocking, step overhead, memory, DCP.

One rank, a DLRM whose ``--tables`` tables of ``--rows`` x ``--dim`` fp32 rows sit in the
device's memory (table-wise, FBGEMM's fused kernel, row-wise Adagrad), batches of ``--batch``
samples with ``--ids`` skewed ids per bag (a few hot rows, a long tail). Every figure is
measured in this run, ours and DCP's interleaved on the same model:

- the ``lost`` phase (``stall_lost.py``, first): training time lost per save (headline diff
  and full, raw full, ``dcp.async_save``), window step ratios, seconds until copied and
  durable, step overhead at one save per ``--overhead-steps`` steps;
- ``tracking_pct``: mean step time with a Checkpointer attached (lookup tracking and the
  copy-on-write hooks, no save) against without one, median of interleaved rounds;
- ``d2h_floor_s``: one copy of every table byte into pinned host memory (CPU: a memcpy);
- ``save_block_s_full`` / ``save_block_s_diff``: how long ``save()`` holds the training thread
  with the default ``CheckpointConfig()`` (its first save is a full, the next a one-shot
  diff), while training goes on during the copy;
- ``extra_hbm_bytes``: the device's peak allocated memory over those saves and the steps
  trained meanwhile, less the peak of the same steps without a save;
- ``host_bytes_peak``: the staging slabs and encoded buffers at their peak (the budget's view);
- ``step_overhead_pct_1_per_100``: mean step time over 300 steps with a full checkpoint after
  steps 100, 200 and 300 (``policy="full"``, default codec; the last is waited for) against
  300 steps without; ``..._adaptive4`` the same with adaptive 4-bit codes;
- ``encode_gbps``: fp32 rows per second through the adaptive 4-bit device encoder (GPU only);
- ``dcp_async_save_block_s``: how long ``torch.distributed.checkpoint.async_save`` blocks;
- ``save_vs_dcp`` / ``restore_vs_dcp``: our full lossless save (waited) and restore against
  ``dcp.save`` / ``dcp.load`` of the model's state dict, best of ``--rounds`` interleaved;
  ``restore_vs_dcp_raw_full`` is the same restore, ``restore_vs_dcp_headline_chain`` the
  restore of the headline codecs' chain (adaptive 4-bit: a full and 5 incremental diffs, 10
  training steps apart) against the same ``dcp.load`` (``stall_dcp.py``: with each restore's
  phases, and on a GPU whether the device decode gives the CPU decode's tables bit for bit).

    PYTHONPATH=/tmp/site:. python3 benchmarks/stall.py                 # the H100 model
    python benchmarks/stall.py --device cpu --rows 200000 --dim 64 --batch 2048   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import write_result  # noqa: E402
from stall_dcp import against_dcp, live_state  # noqa: E402
from stall_lost import lost_phase  # noqa: E402


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    """The DLRM, sharded table-wise on this one rank with FBGEMM's fused kernel."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(0)
    names = [f"t{i}" for i in range(args.tables)]
    tables = [
        EmbeddingBagConfig(
            name=n, embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f_{n}"]
        )
        for n in names
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[512, 256, args.dim],
        over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}
    )
    collection = model.sparse_arch.embedding_bag_collection
    plan = construct_module_sharding_plan(
        collection,
        {n: table_wise(rank=0, compute_kernel="fused") for n in names},
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type=device.type,
    )
    dmp = DistributedModelParallel(
        model,
        device=device,
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
    )
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, torch.optim.Adagrad(list(dense.values()), lr=0.01)


def batches(args: argparse.Namespace, device: torch.device, count: int = 8) -> list[Any]:
    """Skewed ids (u**4 of the rows: a few hot rows, a long tail), fixed bag length."""
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        n = args.tables * args.batch * args.ids
        ids = (torch.rand(n, generator=gen) ** 4 * args.rows).long().clamp_(max=args.rows - 1)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_t{i}" for i in range(args.tables)],
            values=ids,
            lengths=torch.full((args.tables * args.batch,), args.ids, dtype=torch.int32),
        ).to(device)
        dense = torch.rand(args.batch, 13, generator=gen).to(device)
        labels = (torch.rand(args.batch, generator=gen) < 0.3).float().to(device)
        out.append((dense, kjt, labels))
    return out


class Trainer:
    def __init__(self, model: Any, opt: Any, data: list[Any], device: torch.device) -> None:
        self.model, self.opt, self.data, self.device = model, opt, data, device
        self.i = 0

    def step(self) -> None:
        dense, kjt, labels = self.data[self.i % len(self.data)]
        self.i += 1
        self.opt.zero_grad()
        logits = self.model(dense, kjt).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        self.opt.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def mean_step(self, steps: int, every: int = 0, save: Any = None) -> float:
        """Mean seconds per step over ``steps`` (with ``save(step)`` after every
        ``every``-th one), the device synchronised at both ends."""
        self.sync()
        started = time.perf_counter()
        for n in range(1, steps + 1):
            self.step()
            if every and n % every == 0:
                save(n)
        self.sync()
        return (time.perf_counter() - started) / steps


def d2h_floor(model: Any) -> float:
    from embckpt.sharding import discover

    shards = discover(model).shards
    pinned = [
        torch.empty(s.weight.shape, dtype=s.weight.dtype, pin_memory=s.weight.is_cuda)
        for s in shards
    ]
    best = float("inf")
    for _ in range(3):
        if shards[0].weight.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for out, s in zip(pinned, shards, strict=True):
            out.copy_(s.weight, non_blocking=True)
        if shards[0].weight.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def peak_device(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measure(args: argparse.Namespace, record: Any) -> dict[str, Any]:
    """Runs the phases, most important first; each one's figures (or its error) go to ``out``
    and ``record(out)`` at once, so a run cut short keeps what it measured."""
    import torch.distributed as dist

    device = torch.device(args.device)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        # A CPU backend beside NCCL: dcp.async_save stages through it.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    model, opt = build(args, device)
    train = Trainer(model, opt, batches(args, device), device)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    out: dict[str, Any] = {"table_bytes": args.tables * args.rows * args.dim * 4, "errors": {}}
    train.mean_step(20)  # warm up
    phases = [
        ("lost", lambda: lost_phase(train, root, args)),
        ("blocking", lambda: save_blocking(train, root, device)),
        ("exact", lambda: exactness(train, root)),
        ("tracking", lambda: tracking(train, root, args)),
        ("encode", lambda: {"encode_gbps": encode_gbps(model) if device.type == "cuda" else None}),
        ("overhead", lambda: overhead(train, root)),
        ("dcp", lambda: against_dcp(train, root, args)),
    ]
    for name, phase in phases:
        if args.phases and name not in args.phases:
            continue
        started = time.perf_counter()
        try:
            out.update(phase())
        except Exception as exc:
            out["errors"][name] = f"{type(exc).__name__}: {str(exc)[:500]}"
        out[f"phase_s_{name}"] = round(time.perf_counter() - started, 1)
        record(out)
    shutil.rmtree(root, ignore_errors=True)
    return out


def save_blocking(train: Trainer, root: Path, device: torch.device) -> dict[str, Any]:
    """save() with the default config (a full, then a one-shot diff), training on while the
    rows are copied; the device memory beyond the same steps' own, the host staging peak."""
    from embckpt import Checkpointer

    out: dict[str, Any] = {"d2h_floor_s": d2h_floor(train.model)}
    reset_peak(device)
    for _ in range(20):
        train.step()
    train.sync()
    plain_peak = peak_device(device)
    reset_peak(device)
    with Checkpointer(train.model, str(root / "default"), optimizer=train.opt) as ckpt:
        staging = getattr(ckpt._saver, "slabs", None) or ckpt._saver.arena  # older releases
        host_peaks = []
        for kind, step in (("full", 20), ("diff", 40)):
            for _ in range(20):
                train.step()
            train.sync()
            handle = ckpt.save(step)
            out[f"save_block_s_{kind}"] = handle.blocked_s
            steps = 0
            while not handle.done():
                train.step()
                steps += 1
            manifest = handle.wait()
            host_peaks.append(staging.peak_bytes)  # reset by each save
            out[f"save_{kind}_kind"] = manifest.kind
            out[f"save_{kind}_persist_s"] = manifest.stats.get("persist_seconds")
            out[f"save_{kind}_steps_meanwhile"] = steps
        train.sync()
        out["host_bytes_peak"] = max(host_peaks)
        out["host_overflows"] = getattr(staging, "overflows", None)
    out["extra_hbm_bytes"] = max(peak_device(device) - plain_peak, 0)
    shutil.rmtree(root / "default", ignore_errors=True)
    return out


def exactness(train: Trainer, root: Path) -> dict[str, Any]:
    """A full and a diff saved while training goes on restore to the state at their steps,
    bit for bit (the copy-on-write window on this device)."""
    from embckpt import Checkpointer

    found = {}
    with Checkpointer(train.model, str(root / "exact"), optimizer=train.opt) as ckpt:
        expected = {}
        for step in (10, 20):
            for _ in range(10):
                train.step()
            expected[step] = live_state(train)
            handle = ckpt.save(step)
            for _ in range(10):  # the window: these steps update rows being copied
                train.step()
            handle.wait()
        for step in (20, 10):
            ckpt.restore(step, discard_newer=step == 10)
            found[step] = all(
                torch.equal(a, b) for a, b in zip(expected[step], live_state(train), strict=True)
            )
    shutil.rmtree(root / "exact", ignore_errors=True)
    return {"exact_full_step_10": found[10], "exact_diff_step_20": found[20]}


def tracking(train: Trainer, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Steps with a Checkpointer attached (no save) against without one, interleaved."""
    from embckpt import Checkpointer

    plain, tracked = [], []
    for _ in range(args.rounds):
        plain.append(train.mean_step(args.steps))
        with Checkpointer(train.model, str(root / "t"), optimizer=train.opt):
            tracked.append(train.mean_step(args.steps))
    step, with_hooks = statistics.median(plain), statistics.median(tracked)
    return {
        "step_s": step,
        "tracked_step_s": with_hooks,
        "tracking_pct": 100 * (with_hooks / step - 1),
    }


def overhead(train: Trainer, root: Path) -> dict[str, Any]:
    """Mean step time with a full checkpoint after steps 100, 200 and 300 against without."""
    from embckpt import CheckpointConfig, Checkpointer

    out: dict[str, Any] = {}
    for name, options in (("_adaptive4", {"codec": "adaptive", "bits": 4}), ("", {})):
        base = train.mean_step(300)
        folder = root / f"every100{name}"
        config = CheckpointConfig(policy="full", keep_last=1, **options)
        with Checkpointer(train.model, str(folder), optimizer=train.opt, config=config) as ckpt:
            handles: list[Any] = []
            mean = train.mean_step(300, 100, lambda n, h=handles, c=ckpt: h.append(c.save(n)))
            handles[-1].wait()
        out[f"step_overhead_pct_1_per_100{name}"] = 100 * (mean / base - 1)
        out[f"save_block_s_1_per_100{name}"] = [h.blocked_s for h in handles]
        shutil.rmtree(folder, ignore_errors=True)
    return out


def encode_gbps(model: Any) -> float | None:
    """The adaptive 4-bit device encoder's rate over one table's rows (None without it)."""
    try:
        from embckpt.codecs import device_encode, make_codec
        from embckpt.sharding import discover
    except ImportError:
        return None
    weight = discover(model).shards[0].weight
    if not device_encode.is_available(weight.device):
        return None
    return device_encode.measure_gbps(make_codec("adaptive", {"bits": 4}), weight)


SUMMARY = (
    "lost_s_per_save",
    "dcp_async_mode",
    "window_step_ratio_p50",
    "window_step_ratio_p99",
    "window_step_ratio_max",
    "copied_s_headline_diff",
    "durable_s_headline_diff",
    "step_overhead_pct_headline_1_per_{overhead}",
    "step_overhead_pct_raw_full_1_per_{overhead}",
    "save_block_s_full",
    "save_block_s_diff",
    "step_overhead_pct_1_per_100",
    "extra_hbm_bytes",
    "host_bytes_peak",
    "encode_gbps",
    "tracking_pct",
    "d2h_floor_s",
    "dcp_async_save_block_s",
    "save_vs_dcp",
    "restore_vs_dcp",
    "restore_vs_dcp_raw_full",
    "restore_vs_dcp_headline_chain",
    "headline_chain_device_decode_exact",
    "headline_chain_cpu_decode_restore_s",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--ids", type=int, default=8)
    p.add_argument("--steps", type=int, default=100, help="steps per tracking round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--writer", default="auto", choices=("auto", "process", "thread"), help="(lost)")
    p.add_argument(
        "--no-overhead-direct",
        dest="overhead_direct",
        action="store_false",
        help="(lost) skip the blocks of --overhead-steps steps with and without a save",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's intra-op threads (CPU: 1 leaves the other cores to the writer, as a GPU "
        "host's training process does)",
    )
    p.add_argument("--save-every", type=int, default=100, help="steps between saves (lost)")
    p.add_argument("--lost-saves", type=int, default=3, help="saves per case (lost)")
    p.add_argument(
        "--overhead-steps", type=int, default=1000, help="one save per this many steps (lost)"
    )
    p.add_argument("--phases", nargs="*", help="run only these (default: all)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=None, help="result name under benchmarks/results")
    p.add_argument("--copy-to", default=None, help="also write the result here, phase by phase")
    return p


def main() -> None:
    args = parser().parse_args()
    started = time.perf_counter()
    model = {
        k: getattr(args, k)
        for k in (
            "tables",
            "rows",
            "dim",
            "batch",
            "ids",
            "device",
            "save_every",
            "lost_saves",
            "overhead_steps",
            "writer",
            "torch_threads",
        )
    }

    summary = [k.format(overhead=args.overhead_steps) for k in SUMMARY]

    def record(figures: dict[str, Any]) -> None:
        result = {
            "summary": {k: figures.get(k) for k in summary},
            "model": model,
            "figures": figures,
            "seconds": round(time.perf_counter() - started, 1),
        }
        if args.out:
            path = write_result(args.out, result)
            if args.copy_to:
                shutil.copy(path, args.copy_to)
        print(json.dumps({k: figures.get(k) for k in figures if k != "errors"}), flush=True)

    figures = measure(args, record)
    for key in summary:
        print(f"{key:<40} {figures.get(key)}")
    for name, error in figures["errors"].items():
        print(f"{name} failed: {error}")


if __name__ == "__main__":
    main()
