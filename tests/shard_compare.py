"""What a restore is compared against: every block a rank holds, the writer's whole tables
assembled from its ranks' blocks, a rank's whole state as numpy, and where they differ
(test_reshard.py, test_eight_ranks.py, test_packed.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import toy_model as tm
from torchrec.distributed import DistributedModelParallel


def blocks(dmp: DistributedModelParallel, opt: torch.optim.Optimizer, rank: int) -> dict:
    """Every block this rank holds (numpy), and the dense state: what the parent compares."""
    from embckpt.sharding import discover

    out: dict[str, Any] = {"blocks": [], "dense": {}}
    for shard in discover(dmp, rank).shards:
        out["blocks"].append(
            {
                "table": shard.table,
                "row": shard.row_offset,
                "col": shard.col_offset,
                "weight": shard.weight.detach().numpy().copy(),
                "row_states": {n: t.numpy().copy() for n, t in shard.row_states.items()},
                "elem_states": {n: t.numpy().copy() for n, t in shard.elem_states.items()},
            }
        )
    for key, value in dmp.state_dict().items():
        if not hasattr(value, "local_shards") and "embedding_bags" not in key:
            out["dense"][key] = value.numpy().copy()
    for pid, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out["dense"][f"opt:{pid}:{name}"] = torch.as_tensor(value).numpy().copy()
    return out


def assemble(per_rank: list[dict]) -> dict[str, dict[str, np.ndarray]]:
    """Whole tables from the writer's blocks; a row-wise state becomes one value per element
    (each column carries the value of the column block that holds it)."""
    tables: dict[str, dict[str, np.ndarray]] = {}
    for out in per_rank:
        for b in out["blocks"]:
            full = tables.setdefault(b["table"], {})
            rows, cols = b["weight"].shape
            where = (slice(b["row"], b["row"] + rows), slice(b["col"], b["col"] + cols))
            arrays = {"weight": b["weight"]}
            arrays.update({f"elem:{n}": v for n, v in b["elem_states"].items()})
            arrays.update(
                {f"row:{n}": np.repeat(v[:, None], cols, 1) for n, v in b["row_states"].items()}
            )
            for name, value in arrays.items():
                target = full.setdefault(name, np.full((tm.ROWS, tm.DIM), np.nan, value.dtype))
                target[where] = value
    return tables


def compare(truth: dict, per_rank: list[dict], dense_truth: dict) -> list[str]:
    """Where a restored block differs from the writer's tables (exact, except a row-wise
    state averaged over several writer column blocks: to float rounding)."""
    problems = []
    for rank, out in enumerate(per_rank):
        for b in out["blocks"]:
            full = truth[b["table"]]
            rows, cols = b["weight"].shape
            where = (slice(b["row"], b["row"] + rows), slice(b["col"], b["col"] + cols))
            name = f"rank {rank} {b['table']} r{b['row']} c{b['col']}"
            if not np.array_equal(full["weight"][where], b["weight"]):
                problems.append(f"{name}: weights")
            for state, value in b["elem_states"].items():
                if not np.array_equal(full[f"elem:{state}"][where], value):
                    problems.append(f"{name}: {state}")
            for state, value in b["row_states"].items():
                per_column = full[f"row:{state}"][where].astype(np.float64)
                exact = bool((per_column == per_column[:, :1]).all())
                expected = per_column.mean(axis=1).astype(np.float32)
                same = (
                    np.array_equal(expected, value)
                    if exact
                    else np.allclose(expected, value, rtol=1e-6, atol=0)
                )
                if not same:
                    problems.append(f"{name}: {state} ({'exact' if exact else 'mean'})")
        for key, value in dense_truth.items():
            if not np.array_equal(out["dense"].get(key), value):
                problems.append(f"rank {rank}: dense {key}")
    return problems


def state_numpy(model: Any, opt: Any, rank: int) -> dict[str, np.ndarray]:
    """The rank's whole state (``tm.snapshot_state``) as numpy: tensors do not cross the
    launcher's process boundaries."""
    return {k: v.numpy().copy() for k, v in tm.snapshot_state(model, opt, rank).items()}


def differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """The keys whose arrays differ, or that one side lacks."""
    return sorted(
        k for k in set(a) | set(b) if k not in a or k not in b or not np.array_equal(a[k], b[k])
    )
