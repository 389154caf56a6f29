"""Exports: a DCP directory that ``dcp.load`` reads into a fresh DMP (of another plan), and a
safetensors file that loads into the single-process model; the ``export`` and ``restore``
commands."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
import toy_model as tm
from shard_compare import assemble, blocks
from test_reshard import NAMES, PLAN_2, build_planned

from embckpt.cli import main
from embckpt.examples.launcher import run_ranks

# The DCP export is loaded into a model sharded differently from the writer's.
PLAN_LOAD = {"a": "rw", "b": "cw", "c": "tw:0", "d": "twrw", "e": "dp", "f": "tw:1"}


def _save_export_load(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from embckpt import CheckpointConfig, Checkpointer

    config = CheckpointConfig(policy="one_shot", full_every=0, row_group_rows=32, pipeline="off")
    model, opt = build_planned(world_size, 0, PLAN_2)
    with Checkpointer(model, f"{root}/ckpt", optimizer=opt, config=config) as ckpt:
        for step in range(1, 9):
            tm.train_step(model, opt, step, rank, kinds=NAMES, hot=80)
            if step in (4, 8):
                ckpt.save(step).wait()
    out = {"written": blocks(model, opt, rank)}
    if rank == 0:  # the command runs in one process, beside a job that holds a process group
        out["exit_dcp"] = main(
            ["export", f"{root}/ckpt", "--step", "8", "--to", "dcp", f"{root}/dcp"]
        )
    dist.barrier()
    fresh, fresh_opt = build_planned(world_size, 123, PLAN_LOAD)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    out["loaded"] = blocks(fresh, fresh_opt, rank)
    return out


def _plain_dlrm() -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}", embedding_dim=tm.DIM, num_embeddings=tm.ROWS, feature_names=[f"f_{k}"]
        )
        for k in NAMES
    ]
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=tm.NUM_DENSE,
        dense_arch_layer_sizes=[16, tm.DIM],
        over_arch_layer_sizes=[16, 1],
    )


def test_exports_load_into_dcp_and_plain_models(capsys) -> None:
    import safetensors.torch

    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_save_export_load, 2, root)
        assert results[0]["exit_dcp"] == 0
        truth = assemble([r["written"] for r in results])
        dense_truth = {
            k: v for k, v in results[0]["written"]["dense"].items() if not k.startswith("opt:")
        }
        # DCP: every block of the fresh model (another plan) holds the writer's values.
        for rank, r in enumerate(results):
            for b in r["loaded"]["blocks"]:
                rows, cols = b["weight"].shape
                where = (slice(b["row"], b["row"] + rows), slice(b["col"], b["col"] + cols))
                assert np.array_equal(truth[b["table"]]["weight"][where], b["weight"]), (rank, b)
            for key, value in dense_truth.items():
                assert np.array_equal(r["loaded"]["dense"][key], value), (rank, key)

        # safetensors: the whole single-process model, and the tables alone for an EBC.
        assert main(["export", f"{root}/ckpt", "--to", "safetensors", f"{root}/m.safetensors"]) == 0
        model = _plain_dlrm()
        model.load_state_dict(safetensors.torch.load_file(f"{root}/m.safetensors"), strict=True)
        ebc = model.sparse_arch.embedding_bag_collection
        for table, arrays in truth.items():
            assert np.array_equal(
                ebc.embedding_bags[table.rsplit(".", 1)[-1]].weight.detach().numpy(),
                arrays["weight"],
            )
        for key, value in dense_truth.items():
            assert np.array_equal(model.state_dict()[key].numpy(), value), key
        tables_file = f"{root}/tables.safetensors"
        assert (
            main(["export", f"{root}/ckpt", "--to", "safetensors", tables_file, "--tables-only"])
            == 0
        )
        fresh_ebc = _plain_dlrm().sparse_arch.embedding_bag_collection
        fresh_ebc.load_state_dict(safetensors.torch.load_file(tables_file), strict=True)
        for table, arrays in truth.items():
            assert np.array_equal(
                fresh_ebc.embedding_bags[table.rsplit(".", 1)[-1]].weight.detach().numpy(),
                arrays["weight"],
            )

        # `embckpt restore` shows the chain, verifies it and prints the resume recipe.
        capsys.readouterr()
        assert main(["restore", f"{root}/ckpt"]) == 0
        text = capsys.readouterr().out
        assert "step 8" in text and "step 4: full" in text and "step 8: diff" in text
        assert "verify: OK" in text and "ckpt.restore(8)" in text
        damaged = sorted(Path(root, "ckpt", "step_000000000004", "tables").rglob("*.parquet"))[0]
        damaged.write_bytes(damaged.read_bytes()[:-10])
        assert main(["restore", f"{root}/ckpt", "--step", "8"]) == 1
        assert "verify: FAILED" in capsys.readouterr().out
        # Corrupt data is a failed command (1), a step that does not exist bad usage (2).
        assert main(["export", f"{root}/ckpt", "--to", "dcp", f"{root}/dcp2"]) == 1
        assert damaged.name in capsys.readouterr().err
        assert main(["restore", f"{root}/ckpt", "--step", "5"]) == 2
        assert "step 5 is not committed" in capsys.readouterr().err
