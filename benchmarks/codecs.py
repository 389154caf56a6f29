"""Error, size and speed of every row codec on embedding tables of a trained DLRM.

Trains the workload of ``configs/bench_spine.yaml`` (64-dim rows) on 2 gloo ranks for
``--steps`` steps and keeps, from every 64-column table block, the rows training changed: their
final weights, and their weights ``--delta-steps`` steps earlier (so ``final - earlier`` is the
delta a checkpoint interval produces). The tables are cached in ``--cache`` so reruns skip the
training. Then, single-threaded (torch and Arrow on one thread), for every codec, bit width and
entropy stage it measures:

- ``l2_error``: mean over rows of ||decoded - original||_2 (for ``exponent``: of the delta);
- ``bytes_per_row``: the codec's bytes per row after its entropy stage (codes plus per-row
  scale and bias; for zstd/lz4, the Parquet column chunk as compressed), without Parquet's own
  overhead; ``disk_bytes_per_row`` is the whole Parquet file (row ids, lengths, footer) / rows;
- ``ratio_vs_fp32``: ``4 * cols / bytes_per_row``;
- ``encode_gbps`` / ``decode_gbps``: fp32 bytes per second through ``codec.encode`` /
  ``codec.decode`` (steady state: Huffman and k-means caches warm, as over a run);
  ``file_encode_gbps`` / ``file_decode_gbps`` include building and reading the Parquet file,
  which is where zstd and lz4 do their work.

Writes ``benchmarks/results/codecs.json``. The machine is shared: speeds are noisy.

Run: ``.venv/bin/python benchmarks/codecs.py [--rows 131072]``

``--quick`` measures only the speed of the quantizing codecs' ``encode`` / ``decode`` (entropy
``none`` and ``huffman``; for ``adaptive`` also the range search alone and the encode up to its
Parquet file, zstd-compressed (the default stage) and Huffman-coded; for ``huffman`` also the
Huffman stage alone: tables, ``huffman.encode_rows`` and ``huffman.decode_rows`` on the codec's
payload bytes), as the CPU time of the measuring thread (per-core figures on a shared machine),
with each one's l2 error; it prints them, and with
``--write-speeds`` stores them as ``per_core_speeds`` in the results file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the codec round-trip helpers

from codec_roundtrip import encoded_bytes_per_row  # noqa: E402
from common import RESULTS, write_result  # noqa: E402

from embckpt.codecs import huffman, make_codec  # noqa: E402
from embckpt.codecs.common import PAYLOAD, binary_buffers  # noqa: E402
from embckpt.storage.rowfile_read import decode_file  # noqa: E402
from embckpt.storage.rowfile_write import encode_file  # noqa: E402

STAGES = ("none", "huffman", "zstd", "lz4")
BITS = (2, 3, 4, 8)
ROW_GROUP = 65536


def _train_worker(rank: int, world_size: int, config: str, steps: int, delta_steps: int) -> dict:
    from embckpt.config import load_yaml
    from embckpt.data import ResumableSampler
    from embckpt.examples.demo import load_dataset
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model, make_batch, train_step
    from embckpt.examples.workload import DemoConfig
    from embckpt.sharding import discover

    cfg = load_yaml(config, DemoConfig)
    device = rank_device(rank)
    dataset = load_dataset(cfg)
    sampler = ResumableSampler(
        len(dataset), cfg.workload.batch_size, rank=rank, world_size=world_size, seed=0
    )
    model, optimizer = build_model(cfg.workload, device, world_size)
    shards = [s for s in discover(model, rank).writer_shards() if s.num_cols == 64]
    initial = [s.weight.detach().cpu().clone() for s in shards]
    earlier: list[torch.Tensor] = []
    for step in range(1, steps + 1):
        train_step(model, optimizer, make_batch(dataset, next(sampler), cfg.workload, device))
        if step == steps - delta_steps:
            earlier = [s.weight.detach().cpu().clone() for s in shards]
    final, before = [], []
    for start, mid, end in zip(
        initial, earlier, (s.weight.detach().cpu() for s in shards), strict=True
    ):
        changed = (end != start).any(dim=1)
        final.append(end[changed].numpy())
        before.append(mid[changed].numpy())
    return {"final": np.concatenate(final), "earlier": np.concatenate(before)}


def trained_tables(cache: Path, config: str, steps: int, delta_steps: int) -> dict[str, np.ndarray]:
    """Rows of a trained model (cached): ``final`` weights and ``earlier`` ones."""
    if cache.exists():
        with np.load(cache) as data:
            return {k: data[k] for k in data.files}
    from embckpt.examples.launcher import run_ranks

    parts = run_ranks(_train_worker, 2, config, steps, delta_steps)
    tables = {k: np.concatenate([p[k] for p in parts]) for k in ("final", "earlier")}
    np.savez(cache, **tables)
    return tables


def _timed(fn: Any, reps: int) -> tuple[Any, float]:
    fn()  # warm caches (Huffman tables, k-means codebook, allocator)
    best = float("inf")
    result = None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def measure(codec_id: str, options: dict[str, Any], rows: torch.Tensor, reps: int) -> dict:
    """One result row: error, bytes and speeds of one codec configuration on ``rows``."""
    codec = make_codec(codec_id, options)
    n, cols = rows.shape
    fp32 = rows.numel() * 4 / 1e9
    encoded, t_enc = _timed(lambda: codec.encode(rows), reps)
    decoded, t_dec = _timed(lambda: codec.decode(encoded, cols), reps)
    ids = np.arange(n, dtype=np.int64)
    meta = {"codec": codec.get_config()}

    def write() -> pa.Buffer:
        return encode_file(ids, codec.encode(rows), {}, {}, meta, ROW_GROUP)

    data, t_file_enc = _timed(write, max(1, reps - 1))

    def read() -> torch.Tensor:
        batch = decode_file(data, "bench", 0, n)
        return codec.decode(batch.encoded, cols)

    _, t_file_dec = _timed(read, max(1, reps - 1))
    payload = encoded_bytes_per_row(encoded)
    if codec.entropy in ("zstd", "lz4"):
        payload = _column_bytes(data, "payload") / n
    error = (decoded.double() - rows.double()).norm(dim=1).mean().item()
    return {
        "codec": codec_id,
        "bits": options.get("bits"),
        "entropy": codec.entropy,
        "options": {k: v for k, v in options.items() if k not in ("bits", "entropy")},
        "l2_error": error,
        "relative_l2_error": error / rows.double().norm(dim=1).mean().item(),
        "bytes_per_row": round(payload, 3),
        "ratio_vs_fp32": round(4 * cols / payload, 3),
        "disk_bytes_per_row": round(data.size / n, 3),
        "encode_gbps": round(fp32 / t_enc, 4),
        "decode_gbps": round(fp32 / t_dec, 4),
        "file_encode_gbps": round(fp32 / t_file_enc, 4),
        "file_decode_gbps": round(fp32 / t_file_dec, 4),
    }


def _column_bytes(data: pa.Buffer, name: str) -> int:
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    paths = [meta.schema.column(i).path for i in range(len(meta.schema))]
    index = next(i for i, p in enumerate(paths) if p == name or p.startswith(f"{name}.list."))
    return sum(
        meta.row_group(g).column(index).total_compressed_size for g in range(meta.num_row_groups)
    )


def _cpu_time(fn: Any, reps: int) -> tuple[Any, float, float]:
    """``fn()``'s result and its best and median thread CPU time over ``reps`` runs (after one
    warming run: compiled kernels, k-means codebook, Huffman tables)."""
    result = fn()
    times = []
    for _ in range(reps):
        start = time.thread_time()
        result = fn()
        times.append(time.thread_time() - start)
    return result, min(times), float(np.median(times))


def per_core_speeds(rows: torch.Tensor, reps: int) -> list[dict[str, Any]]:
    """Per-core speeds (thread CPU time) and errors of the quantizing codecs with entropy
    ``none`` and ``huffman``, the Huffman stage alone, the adaptive search alone, and the
    adaptive encode up to its Parquet file with the default stage (zstd) and with Huffman."""
    fp32 = rows.numel() * 4 / 1e9
    cols = rows.shape[1]
    out = []
    for codec_id in ("symmetric", "asymmetric", "adaptive", "kmeans"):
        for bits in BITS:
            for stage in ("none", "huffman"):
                codec = make_codec(codec_id, {"bits": bits, "entropy": stage})
                encoded, enc, enc_med = _cpu_time(lambda c=codec: c.encode(rows), reps)
                decoded, dec, dec_med = _cpu_time(
                    lambda c=codec, e=encoded: c.decode(e, cols), reps
                )
                row: dict[str, Any] = {
                    "codec": codec_id,
                    "bits": bits,
                    "entropy": stage,
                    "l2_error": (decoded.double() - rows.double()).norm(dim=1).mean().item(),
                    "encode_gbps_per_core": round(fp32 / enc, 3),
                    "encode_gbps_per_core_median": round(fp32 / enc_med, 3),
                    "decode_gbps_per_core": round(fp32 / dec, 3),
                    "decode_gbps_per_core_median": round(fp32 / dec_med, 3),
                }
                if codec_id == "adaptive" and stage == "none":
                    row["search_gbps_per_core"] = round(fp32 / _search_time(codec, rows, reps), 3)
                    zstd = make_codec(codec_id, {"bits": bits})
                    row["zstd_file_encode_gbps_per_core"] = _file_encode(zstd, rows, reps)
                if stage == "huffman":
                    row.update(_huffman_stage(encoded, fp32, reps))
                    if codec_id == "adaptive":
                        row["file_encode_gbps_per_core"] = _file_encode(codec, rows, reps)
                out.append(row)
                extra = {
                    k: v for k, v in row.items() if any(w in k for w in ("search", "file", "stage"))
                }
                print(
                    f"{codec_id:>10} {bits} {stage:>7} l2 {row['l2_error']:.6f}  "
                    f"enc {row['encode_gbps_per_core']:7.3f}  "
                    f"dec {row['decode_gbps_per_core']:7.3f} GB/s per core  {extra or ''}",
                    flush=True,
                )
    return out


def _file_encode(codec: Any, rows: torch.Tensor, reps: int) -> float:
    """Best per-core speed (GB/s of the fp32 rows) of ``codec.encode`` plus its Parquet file
    (compressed as the codec's entropy stage asks)."""
    ids = np.arange(rows.shape[0], dtype=np.int64)
    meta = {"codec": codec.get_config()}
    _, best, _ = _cpu_time(
        lambda: encode_file(ids, codec.encode(rows), {}, {}, meta, ROW_GROUP), reps
    )
    return round(rows.numel() * 4 / 1e9 / best, 3)


def _huffman_stage(encoded: Any, fp32: float, reps: int) -> dict[str, float]:
    """Best per-core speeds (GB/s of the fp32 rows) of the Huffman stage alone on an encoded
    batch's payload: its tables (cache warm, as over a run) plus ``encode_rows``, and
    ``decode_rows``."""
    tables = [str(t) for t in encoded.metadata["huffman"]]
    columns = huffman.columns_from_runs(encoded.metadata["huffman_columns"], len(tables))
    offsets, buffer = binary_buffers(encoded.columns[PAYLOAD])
    payload = huffman.decode_rows(buffer, offsets, tables, columns)
    cache = huffman.TableCache()
    _, enc, _ = _cpu_time(
        lambda: huffman.encode_rows(payload, cache.tables_for(payload, columns), columns), reps
    )
    _, dec, _ = _cpu_time(lambda: huffman.decode_rows(buffer, offsets, tables, columns), reps)
    return {
        "stage_encode_gbps_per_core": round(fp32 / enc, 3),
        "stage_decode_gbps_per_core": round(fp32 / dec, 3),
    }


def _search_time(codec: Any, rows: torch.Tensor, reps: int) -> float:
    """Best thread CPU time of the adaptive range search alone (adaptive_kernels.search_rows)."""
    from embckpt.codecs import adaptive_kernels

    n = rows.shape[0]
    lo, hi, xmin, xmax = (np.empty(n, dtype=np.float32) for _ in range(4))
    none = np.empty((0, 0), dtype=np.uint8)
    x = rows.numpy()
    steps = codec._steps()
    _, best, _ = _cpu_time(
        lambda: adaptive_kernels.search_rows(
            x, codec.bits, codec.n_bins, steps, True, lo, hi, xmin, xmax, False, none
        ),
        reps,
    )
    return best


def configurations() -> list[tuple[str, dict[str, Any], str]]:
    """(codec, options, data) for every measurement: data is ``weights`` or ``deltas``."""
    runs: list[tuple[str, dict[str, Any], str]] = []
    for stage in STAGES:
        for codec_id in ("raw", "fp16", "bf16"):
            runs.append((codec_id, {"entropy": stage}, "weights"))
        for bits in BITS:
            for codec_id in ("symmetric", "asymmetric", "adaptive", "kmeans"):
                runs.append((codec_id, {"bits": bits, "entropy": stage}, "weights"))
            runs.append(("exponent", {"bits": bits, "entropy": stage}, "deltas"))
    # References for the error comparison: the adaptive search at Check-N-Run's and caffe2's
    # settings, plain k-means, and a uniform codec on the same deltas as exponent.
    for bits in BITS:
        for n_bins, ratio in ((25, 0.6), (200, 0.16)):
            options = {"bits": bits, "entropy": "none", "n_bins": n_bins, "ratio": ratio}
            runs.append(("adaptive", options, "weights"))
        runs.append(("kmeans", {"bits": bits, "entropy": "none", "iterations": 0}, "weights"))
        runs.append(("asymmetric", {"bits": bits, "entropy": "zstd"}, "deltas"))
    return runs


def summarize(results: list[dict]) -> dict[str, Any]:
    """The comparisons the codec docs quote: entropy stages, error ordering, targets."""

    def pick(codec: str, bits: int | None, entropy: str, data: str = "weights") -> dict:
        return next(
            r
            for r in results
            if (r["codec"], r["bits"], r["entropy"], r["data"]) == (codec, bits, entropy, data)
            and not r["options"]
        )

    stages: dict[str, Any] = {}
    for r in results:
        if r["options"] or (r["codec"] == "asymmetric" and r["data"] == "deltas"):
            continue
        key = f"{r['codec']}-{r['bits']}" if r["bits"] else r["codec"]
        stages.setdefault(key, {})[r["entropy"]] = {
            k: r[k]
            for k in ("bytes_per_row", "disk_bytes_per_row", "file_encode_gbps", "file_decode_gbps")
        }
    wins: dict[str, dict[str, int]] = {}
    for metric in ("bytes_per_row", "disk_bytes_per_row"):
        wins[metric] = {"huffman": 0, "zstd": 0, "lz4": 0}
        for entry in stages.values():
            best = min(("huffman", "zstd", "lz4"), key=lambda s, m=metric: entry[s][m])
            wins[metric][best] += 1
    speed = {
        stage: {
            side: float(np.median([e[stage][f"file_{side}_gbps"] for e in stages.values()]))
            for side in ("encode", "decode")
        }
        for stage in ("none", "huffman", "zstd", "lz4")
    }
    ordering = {
        bits: {
            c: pick(c, bits, "none")["l2_error"]
            for c in ("symmetric", "asymmetric", "adaptive", "kmeans")
        }
        for bits in BITS
    }
    huffman4 = {c: pick(c, 4, "huffman") for c in ("symmetric", "asymmetric", "adaptive", "kmeans")}
    huffman4["exponent (deltas)"] = pick("exponent", 4, "huffman", "deltas")
    return {
        "entropy_stages": stages,
        "smallest_stage_counts": wins,
        "median_file_gbps_by_stage": speed,
        "l2_error_by_bits": ordering,
        "targets": {
            "adaptive_4bit_encode_gbps": pick("adaptive", 4, "none")["encode_gbps"],
            "adaptive_below_asymmetric": {
                b: ordering[b]["adaptive"] < ordering[b]["asymmetric"] for b in BITS
            },
            "ratio_4bit_huffman_64dim": {c: r["ratio_vs_fp32"] for c, r in huffman4.items()},
            "ratio_4bit_huffman_64dim_on_disk": {
                c: round(256 / r["disk_bytes_per_row"], 3) for c, r in huffman4.items()
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--delta-steps", type=int, default=50)
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache", default="/tmp/embckpt_codec_bench_tables.npz")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the quantizing codecs' per-core encode/decode speeds (nothing written)",
    )
    parser.add_argument(
        "--write-speeds",
        action="store_true",
        help="with --quick: store the per-core speeds in the results file (per_core_speeds)",
    )
    parser.add_argument(
        "--summarize-only",
        action="store_true",
        help="recompute the summary of the existing results file without measuring again",
    )
    args = parser.parse_args()
    if args.summarize_only:
        import json

        previous = json.loads((RESULTS / "codecs.json").read_text())
        previous["summary"] = summarize(previous["results"])
        (RESULTS / "codecs.json").write_text(json.dumps(previous, indent=1))
        return
    tables = trained_tables(Path(args.cache), args.config, args.steps, args.delta_steps)
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    rng = np.random.default_rng(0)
    final, earlier = tables["final"], tables["earlier"]
    moved = np.flatnonzero((final != earlier).any(axis=1))
    pick_w = rng.choice(len(final), min(args.rows, len(final)), replace=False)
    pick_d = rng.choice(moved, min(args.rows, len(moved)), replace=False)
    data = {
        "weights": torch.from_numpy(np.ascontiguousarray(final[np.sort(pick_w)])),
        "deltas": torch.from_numpy(np.ascontiguousarray((final - earlier)[np.sort(pick_d)])),
    }
    if args.quick:
        speeds = per_core_speeds(data["weights"], args.reps)
        if args.write_speeds:
            import json

            path = RESULTS / "codecs.json"
            previous = json.loads(path.read_text())
            previous["per_core_speeds"] = {
                "notes": (
                    "Thread CPU time of one thread (GB/s of fp32 rows per core), best and median "
                    f"of {args.reps}, on {list(data['weights'].shape)} trained rows; "
                    "zstd_file_encode: encode plus the zstd-compressed Parquet file, the default "
                    "stage (file_encode: the same with Huffman); search: the adaptive range "
                    "search alone; stage_*: the Huffman stage "
                    "alone (tables, encode_rows / decode_rows on the payload bytes). `uptime` "
                    "load at the run: "
                    f"{Path('/proc/loadavg').read_text().split()[:3]}"
                ),
                "results": speeds,
            }
            path.write_text(json.dumps(previous, indent=1))
            print(f"wrote {path}")
        return
    results = []
    for codec_id, options, which in configurations():
        row = measure(codec_id, options, data[which], args.reps)
        row["data"] = which
        results.append(row)
        print(
            f"{codec_id:>10} {str(options.get('bits')):>4} {row['entropy']:>7} {which:>7} "
            f"l2 {row['l2_error']:.5f}  {row['bytes_per_row']:7.2f} B/row "
            f"x{row['ratio_vs_fp32']:6.2f}  enc {row['encode_gbps']:6.3f}  "
            f"dec {row['decode_gbps']:6.3f} GB/s {row['options'] or ''}",
            flush=True,
        )
    path = write_result(
        "codecs",
        {
            "rows": {k: list(v.shape) for k, v in data.items()},
            "trained": {"config": args.config, "steps": args.steps, "ranks": 2},
            "notes": (
                "weights: 64-dim rows the training changed; deltas: their change over the last "
                f"{args.delta_steps} steps. Speeds single-threaded, best of {args.reps}, on a "
                "2-core machine shared with other work: noisy."
            ),
            "results": results,
            "summary": summarize(results),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
