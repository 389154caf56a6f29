"""The touched-row tracker's memory per rank: bytes per row of the blocks a rank holds.

2 gloo ranks build the tests' toy DLRM (``tests/toy_model.py``: table-, row-, column-wise,
table-row-wise and data-parallel tables) with ``--rows`` rows per table and a ``RowTracker``
on each; per rank it sums the tracker's own tensors (the pending bitmap each hook writes and
one accumulator per view), at rest and while a checkpoint holds the bits it took (``take``),
over the rows of the rank's table kernels, and scales to a billion rows. The bitmaps live where
the tables do: on a GPU model, in its memory. Writes ``benchmarks/results/tracker_memory.json``.

Run: ``python benchmarks/tracker_memory.py [--rows 100000]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from common import write_result  # noqa: E402

from embckpt.examples.launcher import run_ranks  # noqa: E402


def _worker(rank: int, world_size: int, rows: int) -> dict[str, Any]:
    import toy_model as tm

    from embckpt.sharding import discover
    from embckpt.tracking import RowTracker, View

    model, _ = tm.build(world_size, seed=0, rows=rows)
    tracker = RowTracker(model, discover(model, rank).shards, None)
    try:
        kernel_rows = sum(m.pending.numel() for m in tracker._modules)
        at_rest = sum(m.pending.numel() * m.pending.element_size() for m in tracker._modules)
        at_rest += sum(t.numel() * t.element_size() for v in tracker._views.values() for t in v)
        taken = tracker.take(View.SINCE_LAST)
        in_checkpoint = at_rest + sum(t.numel() * t.element_size() for t in taken)
    finally:
        tracker.close()
    return {"rows": kernel_rows, "bytes_at_rest": at_rest, "bytes_in_checkpoint": in_checkpoint}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    args = parser.parse_args()
    ranks = run_ranks(_worker, 2, args.rows)
    per_row = max(r["bytes_at_rest"] / r["rows"] for r in ranks)
    per_row_peak = max(r["bytes_in_checkpoint"] / r["rows"] for r in ranks)
    summary = {
        "bytes_per_row": per_row,
        "bytes_per_billion_rows": per_row * 1e9,
        "bytes_per_row_in_checkpoint": per_row_peak,
        "bytes_per_billion_rows_in_checkpoint": per_row_peak * 1e9,
    }
    path = write_result(
        "tracker_memory", {"args": vars(args), "per_rank": ranks, "summary": summary}
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
