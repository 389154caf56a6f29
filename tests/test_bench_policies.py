"""The policies benchmark's pieces: the future-knowing schedule and the per-row byte budget."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from byte_budget import PARTS, checkpoint_budget  # noqa: E402
from oracle import (  # noqa: E402
    Pricing,
    best_bounded_schedule,
    best_schedule,
    one_shot_parents,
    schedule_bytes,
    union_counts,
)

HUFFMAN_STEP = Path(__file__).parent / "fixtures/v1/adaptive_incremental/step_000000000005"


def test_union_counts_match_set_unions() -> None:
    rng = np.random.default_rng(0)
    touched = rng.random((6, 40)) < 0.2
    counts = union_counts(touched)
    for first, last in itertools.product(range(6), range(6)):
        rows = set().union(*(set(np.flatnonzero(touched[i])) for i in range(first + 1, last + 1)))
        assert counts[first, last] == (len(rows) if last > first else 0)


def test_best_schedule_is_the_cheapest_of_every_schedule() -> None:
    rng = np.random.default_rng(1)
    touched = rng.random((7, 200)) < rng.random((7, 1)) * 0.4
    counts = union_counts(touched)
    pricing = Pricing(full_bytes=400.0, diff_row_bytes=2.0, diff_fixed_bytes=30.0)
    costs = pricing.diff_costs(counts)
    cheapest = min(
        schedule_bytes(one_shot_parents(["full", *rest]), pricing.full_bytes, costs)
        for rest in itertools.product(["full", "diff"], repeat=6)
    )
    total, kinds = best_schedule(pricing.full_bytes, costs)
    assert kinds[0] == "full"
    assert np.isclose(total, cheapest)
    assert np.isclose(schedule_bytes(one_shot_parents(kinds), pricing.full_bytes, costs), total)


def _walk(
    kinds: tuple[str, ...], full: float, costs: np.ndarray, link: float = 0.0
) -> tuple[float, float]:
    """Bytes written and the most any restore reads (``link`` more per diff it reads), for a
    schedule of F / d / i."""
    written = most = chain = 0.0
    f = links = 0
    for t, kind in enumerate(kinds):
        if kind == "F":
            f, links = t, 0
            chain = cost = full
        elif kind == "d":
            cost = costs[f, t]
            chain, links = full + cost, 1
        else:
            cost = costs[t - 1, t]
            chain, links = chain + cost, links + 1
        written += cost
        most = max(most, chain + link * links if kind != "F" else 0.0)
    return written, most


def test_bounded_schedule_is_the_cheapest_within_the_bound() -> None:
    """Against every schedule of fulls, one-shot and incremental diffs of 7 intervals."""
    rng = np.random.default_rng(2)
    touched = rng.random((7, 300)) < rng.random((7, 1)) * 0.3
    pricing = Pricing(full_bytes=400.0, diff_row_bytes=2.0, diff_fixed_bytes=10.0)
    costs = pricing.diff_costs(union_counts(touched))
    for bound in (math.inf, 700.0, 550.0, 450.0, 300.0):
        feasible = [
            _walk(("F", *rest), pricing.full_bytes, costs)[0]
            for rest in itertools.product("Fdi", repeat=6)
            if _walk(("F", *rest), pricing.full_bytes, costs)[1] <= bound
        ]
        total, kinds = best_bounded_schedule(pricing.full_bytes, costs, bound)
        assert np.isclose(total, min(feasible)), bound
        written, most = _walk(tuple(kinds), pricing.full_bytes, costs)
        assert np.isclose(written, total) and most <= bound
    assert kinds == ["F"] * 7  # a bound below any diff leaves fulls alone


def test_bounded_schedule_counts_each_link_s_fixed_cost_against_the_bound() -> None:
    """``link_bytes``: every diff a restore reads costs that much more; against every
    schedule of 7 intervals, for several bounds and link costs."""
    rng = np.random.default_rng(3)
    touched = rng.random((7, 300)) < rng.random((7, 1)) * 0.3
    pricing = Pricing(full_bytes=400.0, diff_row_bytes=2.0, diff_fixed_bytes=10.0)
    costs = pricing.diff_costs(union_counts(touched))
    schedules = [("F", *rest) for rest in itertools.product("Fdi", repeat=6)]
    lengths = []
    for link, bound in itertools.product((0.0, 40.0, 150.0), (math.inf, 700.0, 550.0)):
        walks = [_walk(kinds, pricing.full_bytes, costs, link) for kinds in schedules]
        total, kinds = best_bounded_schedule(pricing.full_bytes, costs, bound, link)
        assert np.isclose(total, min(w for w, most in walks if most <= bound)), (link, bound)
        written, most = _walk(tuple(kinds), pricing.full_bytes, costs, link)
        assert np.isclose(written, total) and most <= bound
        if bound == 700.0:
            lengths.append(max(len(c) for c in "".join(kinds).split("F")))
    assert lengths[0] > lengths[-1]  # costlier links: shorter chains under the same bound


def test_the_restore_frontier_writes_less_as_links_cost_less() -> None:
    """``restore_frontier.py``: under ``dcp.load``'s time, cheaper links allow longer chains
    and so fewer bytes written; the model's link cost is the measured per-link time less the
    link's bytes at the full's rate."""
    from restore_frontier import frontier

    rng = np.random.default_rng(4)
    counts = union_counts(rng.random((12, 2000)) < 0.03)
    workload = {
        "workload": "synthetic",
        "oracle": {
            "pricing": {"full_bytes": 8e5, "diff_row_bytes": 20.0, "diff_fixed_bytes": 1e3},
            "write_reduction_x": 1.0,
        },
        "union_counts": counts.tolist(),
        "full_restore_s": 0.030,
        "restore_s_per_extra_link": 0.006,
        "dcp_load_s": 0.045,
        "full_fp32_bytes": 4e6,
        "write_reduction_x": 1.0,
        "chain_links": 1,
        "restore_vs_dcp_load": 1.0,
    }
    row = frontier(workload)
    reductions = [r["write_reduction_x"] for r in row["within_dcp_load"]]
    links = [r["most_links_read"] for r in row["within_dcp_load"]]
    assert reductions == sorted(reductions) and reductions[0] < reductions[-1], reductions
    assert links == sorted(links), links
    model = row["model"]
    link_s = model["link_fixed_s"] + model["median_link_bytes"] * model["restore_s_per_byte"]
    assert np.isclose(link_s, 0.006) and np.isclose(model["restore_s_per_byte"], 0.030 / 8e5)


def test_a_schedule_prices_each_diff_on_its_parent() -> None:
    touched = np.eye(4, dtype=bool).repeat(10, axis=1)  # interval t touches its own 10 rows
    costs = Pricing(full_bytes=100.0, diff_row_bytes=1.0, diff_fixed_bytes=0.0).diff_costs(
        union_counts(touched)
    )
    assert one_shot_parents(["full", "diff", "full", "diff"]) == [None, 0, None, 2]
    one_shot = schedule_bytes([None, 0, 0, 0], 100.0, costs)  # 10 + 20 + 30 rows
    incremental = schedule_bytes([None, 0, 1, 2], 100.0, costs)  # 10 + 10 + 10 rows
    assert (one_shot, incremental) == (160.0, 130.0)


def test_best_schedule_takes_a_full_when_diffs_grow_past_it() -> None:
    counts = np.triu(np.full((4, 4), 100), k=1)  # every diff writes 100 rows
    _, kinds = best_schedule(50.0, Pricing(50.0, 1.0, 0.0).diff_costs(counts))
    assert kinds == ["full"] * 4
    _, kinds = best_schedule(500.0, Pricing(500.0, 1.0, 0.0).diff_costs(counts))
    assert kinds == ["full", "diff", "diff", "diff"]


def test_budget_parts_add_up_to_the_files_and_huffman_bits_are_exact() -> None:
    budget = checkpoint_budget(HUFFMAN_STEP)
    on_disk = sum(p.stat().st_size for p in HUFFMAN_STEP.rglob("*") if p.is_file())
    assert np.isclose(sum(budget["parts"].values()), on_disk)
    assert set(budget["parts"]) == set(PARTS)
    assert budget["parts"]["codec"] == 0  # every payload split into codes and scale+bias
    payload_bytes = rows = 0
    for path in HUFFMAN_STEP.glob("tables/*/*.parquet"):
        column = pq.read_table(path, columns=["payload"]).column("payload").combine_chunks()
        offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[: len(column) + 1]
        payload_bytes += int(offsets[-1] - offsets[0])
        rows += len(column)
    coded = budget["parts"]["codes"] + budget["parts"]["scale_bias"]
    # Each row's bit string is byte-aligned: less than a byte of padding per row.
    assert coded <= payload_bytes < coded + rows
    assert budget["rows"] == rows


def test_the_family_spans_the_issue_s_ranges_and_measures_the_defaults() -> None:
    """benchmarks/family.py: workloads spanning Zipf 1.0-1.4, 10k to 10M rows per table, 16 to
    128 columns, short and long intervals and a warm start; its ``default`` run is the headline
    setting with nothing else set, its ``previous`` run the restore bound of issues 22-30."""
    from family import FAMILY, settings

    from embckpt.config import CheckpointConfig
    from embckpt.policy import make_policy

    assert len(FAMILY) >= 6
    assert {min(m.alpha for m in FAMILY), max(m.alpha for m in FAMILY)} == {1.0, 1.4}
    tables = [n for m in FAMILY for n in m.cardinalities()]
    assert all(len(m.cardinalities()) == 8 for m in FAMILY)
    assert max(tables) == 10_000_000 and any(m.equal and m.rows // 8 == 10_000 for m in FAMILY)
    assert {min(m.dim for m in FAMILY), max(m.dim for m in FAMILY)} == {16, 128}
    assert any(m.warmup >= 500 for m in FAMILY)
    assert max(m.every for m in FAMILY) >= 20 * min(m.every for m in FAMILY)
    configs = settings(["log8={optimizer_codec: log8}"])
    headline = CheckpointConfig(policy="intermittent", codec="adaptive", bits=4, keep_last=1)
    assert configs["default"] == headline
    previous = make_policy(configs["previous"])
    assert (previous.max_chain, previous.max_restore_fp32) == (1.2, math.inf)
    assert configs["previous"].optimizer_codec == "raw"
    assert make_policy(configs["default"]).chain_floor == 1.2
    assert configs["candidate_log8"].optimizer_codec == "log8"
    assert configs["full"].policy == "full"
