"""embckpt on a GPU: exactness on every kernel location (``benchmarks/locations.py``), written to
``benchmarks/results/gpu.json``; with ``--stall``, ``benchmarks/stall.py``'s figures of the
same run (save() blocking, step overhead, memory, encode rate, tracking, DCP) join its summary.

    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu.py            # the GPU machine
    python benchmarks/gpu.py --device cpu --optimizers sgd      # the scenario on CPU (dry run)

``summary.exact_by_case`` maps ``"<optimizer>/<location>/<codec>"`` to whether every check of
the case held (restore into a fresh and a trained model, continuing, rollback, discard_newer;
with ``raw`` also against the uninterrupted run). ``cases`` holds each case's checks with the
differences found; ``not_run`` the cases FBGEMM or TorchRec refused to build, with their error.
Caching cases also run the trained restore with FBGEMM's cache left alone (``without_fix``),
which shows what the scenario catches. Cases run on ``--workers`` one-rank processes at once.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import write_result  # noqa: E402
from locations import CODECS, Case, cases, run_cases  # noqa: E402


def release_set() -> dict[str, str | None]:
    """The torch, FBGEMM and TorchRec releases the run used."""

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return f"{name} {metadata.version(name)}"
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "torch": version("torch"),
        "fbgemm": version("fbgemm-gpu", "fbgemm-gpu-cpu"),
        "torchrec": version("torchrec"),
    }


def warm_kernels() -> None:
    """Compiles the lossy codec's CPU kernels once, into numba's cache on disk, before the
    workers start: each would compile them on its own otherwise."""
    import torch

    from embckpt.config import CheckpointConfig, codec_for

    options = {k: v for k, v in CODECS["adaptive4"].items() if k in ("codec", "bits")}
    codec = codec_for(CheckpointConfig(**options))
    rows = torch.randn(512, 16)
    codec.decode(codec.encode(rows), rows.shape[1])


def run(selected: list[Case], device: str, workers: int, without_fix: bool) -> list[dict]:
    """Runs the cases on ``workers`` one-rank jobs at once, each in its own process."""
    from embckpt.examples.launcher import run_ranks

    groups = [selected[i::workers] for i in range(workers) if selected[i::workers]]
    with tempfile.TemporaryDirectory() as root:
        with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
            jobs = [
                pool.submit(run_ranks, run_cases, 1, group, f"{root}/w{i}", device, without_fix)
                for i, group in enumerate(groups)
            ]
            results = [case for job in jobs for case in job.result()[0]]
    order = {case.name: i for i, case in enumerate(selected)}
    return sorted(results, key=lambda r: order[r["case"]])


def summarise(results: list[dict[str, Any]], device: str) -> dict[str, Any]:
    import torch

    ran = [r for r in results if "error" not in r]
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {
        "summary": {
            "device": name,
            "exact_by_case": {r["case"]: r["exact"] for r in ran},
            "all_exact": all(r["exact"] for r in ran),
            "without_fix_exact": {
                r["case"]: r["without_fix"]["exact"] for r in ran if "without_fix" in r
            },
        },
        "release_set": release_set(),
        "cases": ran,
        "not_run": {r["case"]: r["error"] for r in results if "error" in r},
    }


def print_table(results: list[dict[str, Any]]) -> None:
    for r in results:
        if "error" in r:
            print(f"{r['case']:<48} not run: {r['error'][:150]}")
            continue
        failed = [k for k, v in r["checks"].items() if v]
        extra = ""
        if "without_fix" in r:
            extra = f"  (without the fix: {'exact' if r['without_fix']['exact'] else 'WRONG'})"
        verdict = "exact" if r["exact"] else f"DIFFERS: {failed}"
        kinds = ",".join(r["kinds"])
        print(f"{r['case']:<48} {verdict}  [{kinds}] {r['seconds']:.1f}s{extra}")
        for check in failed:
            print(f"    {check}: {r['checks'][check][:4]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--optimizers", nargs="*", help="default: every one (locations.py)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--no-without-fix", action="store_true")
    parser.add_argument("--out", default="gpu", help="result name under benchmarks/results")
    parser.add_argument(
        "--stall",
        type=Path,
        help="benchmarks/stall.py's result of this run: its summary joins this one's",
    )
    args = parser.parse_args()
    selected = cases(args.device, tuple(args.optimizers) if args.optimizers else None)
    started = time.perf_counter()
    warm_kernels()
    results = run(selected, args.device, args.workers, not args.no_without_fix)
    print_table(results)
    result = summarise(results, args.device)
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.stall is not None:
        stall = json.loads(args.stall.read_text())
        result["summary"].update(stall["summary"])
        result["snapshot"] = {k: stall[k] for k in ("model", "figures", "machine") if k in stall}
    path = write_result(args.out, result)
    print(
        f"{len(result['cases'])} cases run, {len(result['not_run'])} not run, "
        f"all exact: {result['summary']['all_exact']}; {path} ({result['seconds']} s)"
    )


if __name__ == "__main__":
    main()
