"""Restoring onto another world size and sharding plan (gloo ranks), partial reads that verify
what they read, additive codecs, and the chain error.

A chain written by 2 ranks under one plan is restored onto 1 rank and onto 4 ranks under other
plans (table-, row-, column-, table-row-wise and data-parallel tables, each changing type), and
every row and optimizer value is compared with the writer's, table by table.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import delta_codec  # noqa: F401  (registers test_delta)
import numpy as np
import pyarrow as pa
import pytest
import torch
import toy_model as tm
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from shard_compare import assemble, blocks, compare
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embckpt.codecs.base import Codec, EncodedRows, fixed_binary_column, fixed_binary_values
from embckpt.codecs.base import register as register_codec
from embckpt.examples.launcher import run_ranks

NAMES = ("a", "b", "c", "d", "e", "f")
# The writer's plan (2 ranks) and two readers' plans: every table changes sharding type or
# block layout. "cw" spans all ranks; "tw:R" pins rank R.
PLAN_2 = {"a": "tw:1", "b": "rw", "c": "cw", "d": "twrw", "e": "dp", "f": "cw"}
PLAN_1 = {"a": "rw", "b": "tw:0", "c": "tw:0", "d": "rw", "e": "dp", "f": "cw"}
PLAN_4 = {"a": "cw", "b": "twrw", "c": "rw", "d": "tw:2", "e": "dp", "f": "cw"}
HOT = 80
STEPS = (4, 8, 12)  # full, diff, diff (incremental: a chain of three)


@register_codec
class Rowwise8Bit(Codec):
    """A lossy 8-bit row-wise quantizer (FBGEMM), standing in for the quantizing codecs."""

    codec_id = "test_q8"

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        packed = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(rows.float().contiguous())
        return EncodedRows(columns={"payload": fixed_binary_column(packed.numpy())})

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        packed = torch.from_numpy(fixed_binary_values(encoded.columns["payload"]).copy())
        return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(packed)


class Counter:
    """A stateful with a value: the same on every rank, or not."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


def build_planned(
    world_size: int,
    seed: int,
    plan: dict[str, str],
    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD,
) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The toy DLRM with tables ``t_a`` .. ``t_f`` sharded as ``plan`` says."""
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}", embedding_dim=tm.DIM, num_embeddings=tm.ROWS, feature_names=[f"f_{k}"]
        )
        for k in NAMES
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=tm.NUM_DENSE,
        dense_arch_layer_sizes=[16, tm.DIM],
        over_arch_layer_sizes=[16, 1],
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": optimizer, "learning_rate": 0.1}
    )
    generators = {f"t_{name}": _generator(spec, world_size) for name, spec in plan.items()}
    module_plan = construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection,
        generators,
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    for name, spec in plan.items():
        if spec == "twrw":
            module_plan[f"t_{name}"].compute_kernel = "fused"
    sharding = ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan})
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=sharding, sharders=[sharder]
    )
    dense_opt = torch.optim.Adagrad(
        list(dict(in_backward_optimizer_filter(dmp.named_parameters())).values()), lr=0.05
    )
    return dmp, dense_opt


def _generator(spec: str, world_size: int) -> Any:
    kind, _, rank = spec.partition(":")
    if kind == "tw":
        return table_wise(rank=int(rank), compute_kernel="fused")
    if kind == "rw":
        return row_wise(compute_kernel="fused")
    if kind == "cw":
        return column_wise(ranks=list(range(world_size)), compute_kernel="fused")
    if kind == "twrw":
        return table_row_wise(host_index=0)
    return data_parallel()


def _save(rank: int, world_size: int, root: str) -> dict:
    """Writes the lossless and the quantized chains (2 ranks, PLAN_2) and reads the quantized
    one back onto the same plan."""
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.data import ResumableSampler

    out: dict[str, Any] = {}
    for name, codec, optimizer in (
        ("lossless", "raw", EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        ("quantized", "test_q8", EmbOptimType.EXACT_ADAGRAD),
    ):
        config = CheckpointConfig(
            policy="incremental",
            full_every=0,
            codec=codec,
            optimizer_codec="raw",  # the rows' codec alone is lossy: the truths below
            row_group_rows=20,
            pipeline="off",
        )
        model, opt = build_planned(world_size, 0, PLAN_2, optimizer)
        statefuls = {
            "shared": Counter(0),
            "mine": Counter(0),
            "sampler": ResumableSampler(1024, 8, rank=rank, world_size=world_size),
        }
        with Checkpointer(
            model, f"{root}/{name}", optimizer=opt, config=config, statefuls=statefuls
        ) as ckpt:
            for step in range(1, STEPS[-1] + 1):
                tm.train_step(model, opt, step, rank, kinds=NAMES, hot=HOT)
                statefuls["shared"].value = step
                statefuls["mine"].value = 100 * rank + step
                next(statefuls["sampler"])
                if step in STEPS:
                    ckpt.save(step).wait()
        out[name] = blocks(model, opt, rank)
        if name == "quantized":
            fresh, fresh_opt = build_planned(world_size, 7, PLAN_2, optimizer)
            with Checkpointer(fresh, f"{root}/{name}", optimizer=fresh_opt, config=config) as c:
                result = c.load()
                assert result is not None
                out["quantized_same_plan"] = blocks(fresh, fresh_opt, rank)
    return out


def _restore(rank: int, world_size: int, root: str, plan: dict[str, str]) -> dict:
    """Restores the lossless chain (and, onto 1 rank, the quantized one) onto ``plan`` with
    fresh, differently seeded models."""
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.data import ResumableSampler

    out: dict[str, Any] = {}
    for name, optimizer in (
        ("lossless", EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        ("quantized", EmbOptimType.EXACT_ADAGRAD),
    ):
        if name == "quantized" and world_size != 1:
            continue  # onto one other plan is enough for the codec; keeps the test short
        model, opt = build_planned(world_size, 1000 + world_size, plan, optimizer)
        statefuls = {
            "shared": Counter(-1),
            "mine": Counter(-1),
            "sampler": ResumableSampler(1024, 8, rank=rank, world_size=world_size),
        }
        config = CheckpointConfig(policy="incremental", full_every=0, pipeline="off")
        with Checkpointer(
            model, f"{root}/{name}", optimizer=opt, config=config, statefuls=statefuls
        ) as ckpt:
            result = ckpt.load(STEPS[-1], threads=3)
            assert result is not None
            out[name] = blocks(model, opt, rank)
            out[f"{name}_result"] = {
                "chain": result.chain,
                "whole_files": _overlapping_bytes(ckpt, STEPS[-1]),
                "bytes_read": result.cost.bytes_read,
                "bytes_needed": result.cost.bytes_needed,
                "skipped": result.skipped,
                "shared": statefuls["shared"].value,
                "mine": statefuls["mine"].value,
            }
            # The restored model checkpoints on: a diff on top of the restored chain.
            tm.train_step(model, opt, 13, rank, kinds=NAMES, hot=HOT)
            manifest = ckpt.save(100 + world_size).wait()
            assert manifest is not None
            out[f"{name}_next"] = (manifest.kind, manifest.parent_step, manifest.world_size)
    if world_size == 1:
        # Not supported: a data-parallel table whose optimizer state lives in the dense
        # optimizer becoming sharded. Refused before anything is loaded.
        model, opt = build_planned(world_size, 5, {**plan, "e": "tw:0"})
        before = blocks(model, opt, rank)
        with Checkpointer(model, f"{root}/lossless", optimizer=opt) as ckpt:
            try:
                ckpt.load(STEPS[-1])
                out["dp_to_tw"] = None
            except Exception as exc:  # the test asserts the type and message
                out["dp_to_tw"] = f"{type(exc).__name__}: {exc}"
        after = blocks(model, opt, rank)
        out["dp_to_tw_untouched"] = all(
            np.array_equal(x["weight"], y["weight"])
            for x, y in zip(before["blocks"], after["blocks"], strict=True)
        )
    return out


def _overlapping_bytes(ckpt: Any, step: int) -> int:
    """Bytes of the chain's rows files whose block overlaps one of this rank's blocks: what a
    reader without row-group selection would read."""
    from embckpt.storage.chain import read_chain

    return sum(
        entry.bytes
        for manifest in read_chain(ckpt.store, step)
        for entry in manifest.files
        if entry.role == "rows"
        and any(
            entry.table == s.table
            and entry.overlaps(
                s.row_offset, s.row_offset + s.num_rows, s.col_offset, s.col_offset + s.num_cols
            )
            for s in ckpt.sharded.shards
        )
    )


def test_restore_onto_other_world_sizes_and_plans() -> None:
    with tempfile.TemporaryDirectory() as root:
        written = run_ranks(_save, 2, root)
        onto = {1: run_ranks(_restore, 1, root, PLAN_1), 4: run_ranks(_restore, 4, root, PLAN_4)}

    for name in ("lossless", "quantized"):
        truth = assemble([w[name] for w in written])
        dense_truth = written[0][name]["dense"]
        same_plan = [w["quantized_same_plan"] for w in written]
        for world_size, results in onto.items():
            if name not in results[0]:
                continue
            where = f"{name} onto {world_size} ranks"
            restored = [r[name] for r in results]
            if name == "lossless":
                assert compare(truth, restored, dense_truth) == [], where
            else:
                # Quantized weights are lossy, but a plan change must not change them: the
                # same values as onto the writer's plan; optimizer state (raw) is exact.
                reference = assemble(same_plan)
                assert any(
                    not np.array_equal(reference[t]["weight"], truth[t]["weight"]) for t in truth
                ), "the test codec should be lossy"
                lossy_truth = {t: {**truth[t], "weight": reference[t]["weight"]} for t in truth}
                assert compare(lossy_truth, same_plan, dense_truth) == [], "same plan"
                assert compare(reference, restored, dense_truth) == [], where
            for r in results:
                info = r[f"{name}_result"]
                assert info["chain"] == STEPS, where
                # World size changed: RNG is not restored; a rank-independent stateful is (from
                # rank 0); a rank-dependent one is not; the sampler refuses another world size.
                assert info["shared"] == STEPS[-1], where
                assert info["mine"] == -1, where
                skipped = " | ".join(info["skipped"])
                assert "RNG" in skipped and "'mine'" in skipped, (where, skipped)
                assert "'sampler'" in skipped and "world_size" in skipped, (where, skipped)
                assert r[f"{name}_next"] == ("diff", STEPS[-1], world_size), where
    refused = onto[1][0]["dp_to_tw"]
    assert refused and "ModelMismatchError" in refused and "data-parallel" in refused
    assert onto[1][0]["dp_to_tw_untouched"]
    # Row-group selection: on 4 ranks no rank reads all of the files its blocks overlap.
    for rank, r in enumerate(onto[4]):
        info = r["lossless_result"]
        assert info["bytes_needed"] < info["bytes_read"] < info["whole_files"], (rank, info)


# -- single-process checks: partial reads verify what they use; additive codecs add ----------
def test_partial_read_checks_only_and_all_of_what_it_reads() -> None:
    from embckpt.codecs import make_codec
    from embckpt.errors import CheckpointCorruptError
    from embckpt.storage.rowfile_read import open_ranges
    from embckpt.storage.rowfile_write import encode_file, index_file

    def read_indexed(source, size, index, groups, path, lo, hi):
        checked = open_ranges(source, path, size, index, groups)
        return checked, list(checked.read(lo, hi))

    codec = make_codec("raw")
    rows = np.arange(0, 3000, 3)
    weights = torch.randn(len(rows), 4)
    data = encode_file(
        rows=rows,
        encoded=codec.encode(weights),
        row_states={"m": np.arange(len(rows), dtype=np.float32)},
        elem_states={},
        metadata={"codec": codec.get_config()},
        row_group_rows=100,
    )
    index = index_file(data)
    assert len(index.row_groups) == 10 and index.row_groups[0].offset == 4
    lo, hi = 1000, 1600  # rows 333..533 by position: row groups 3, 4 and 5
    groups = [i for i, g in enumerate(index.row_groups) if g.first_row < hi and lo <= g.last_row]
    assert groups == [3, 4, 5]
    fetched: list[tuple[int, int]] = []

    class fetch_from:  # noqa: N801 - a source that records the ranges fetched
        def __init__(self, blob: bytes) -> None:
            self._file = pa.BufferReader(blob)
            self._at = 0

        def seek(self, position: int) -> int:
            self._at = self._file.seek(position)
            return self._at

        def read_buffer(self, nbytes: int) -> pa.Buffer:
            fetched.append((self._at, nbytes))
            return self._file.read_buffer(nbytes)

        def close(self) -> None:
            self._file.close()

    good = data.to_pybytes()
    checked, blocks = read_indexed(fetch_from(good), len(good), index, groups, "f", lo, hi)
    expected = (rows >= lo) & (rows < hi)
    assert np.array_equal(np.concatenate([b.rows for b in blocks]), rows[expected])
    decoded = torch.cat([codec.decode(b.encoded, 4) for b in blocks])
    assert torch.equal(decoded, weights[torch.from_numpy(expected)])
    assert np.array_equal(checked.row_ids(), rows[300:600])  # whole row groups 3 to 5
    fetched_bytes = sum(n for _, n in fetched)
    assert fetched_bytes == checked.bytes_read < len(good) / 2
    # Damage outside the groups read goes unnoticed (not used); inside, or in the footer, not.
    for position, caught in (
        (index.row_groups[0].offset + 50, False),
        (index.row_groups[4].offset + 50, True),
        (len(good) - 30, True),
    ):
        damaged = bytearray(good)
        damaged[position] ^= 0xFF
        if caught:
            with pytest.raises(CheckpointCorruptError, match="CRC32C"):
                read_indexed(fetch_from(bytes(damaged)), len(good), index, groups, "f", lo, hi)
        else:
            read_indexed(fetch_from(bytes(damaged)), len(good), index, groups, "f", lo, hi)
    with pytest.raises(CheckpointCorruptError, match=r"f: (cannot read bytes|bytes) \d+\+\d+"):
        read_indexed(fetch_from(good[: len(good) // 2]), len(good), index, groups, "f", lo, hi)


def _write_chain(root: Path, diff_codec: str) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A two-checkpoint chain of one 10 x 4 table written by hand: a raw full checkpoint and a
    diff of rows 2, 5, 7 encoded with ``diff_codec``."""
    from embckpt import dense
    from embckpt.codecs import make_codec
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.layout import MANIFEST_NAME
    from embckpt.storage.manifest import FileEntry, Manifest, TableEntry
    from embckpt.storage.rowfile_write import encode_file, index_file

    store = CheckpointStore(root, fsync=False)
    base = torch.randn(10, 4)
    diff_rows = np.array([2, 5, 7])
    diff = torch.randn(3, 4)
    table = TableEntry("t", 10, 4, "float32", "row_wise", (), (), ((0, 0, 0, 10, 4),))
    empty_dense = dense.encode_tree({"model": {}, "optimizer": None, "fused_scalars": {}})
    parent = None
    for step, rows, values, codec_id in (
        (1, np.arange(10), base, "raw"),
        (2, diff_rows, diff, diff_codec),
    ):
        codec = make_codec(codec_id)
        data = encode_file(
            rows=rows,
            encoded=codec.encode(values),
            row_states={},
            elem_states={},
            metadata={"codec": codec.get_config(), "state_codec": {"id": "raw"}},
            row_group_rows=2,
        )
        w = store.write_file(step, "tables/t/r0_c0.p0.parquet", data)
        d = store.write_file(step, "dense/model.safetensors", empty_dense)
        rows_entry = FileEntry(w.path, w.bytes, w.checksum, "rows", 0, "t", 0, 0, 10, 4, len(rows))
        files = (
            replace(rows_entry, fqn="embedding_bags.t.weight", index=index_file(data)),
            FileEntry(d.path, d.bytes, d.checksum, "dense", 0),
        )
        manifest = Manifest(
            step=step,
            kind="full" if parent is None else "diff",
            policy="incremental",
            base_step=1,
            parent_step=parent,
            world_size=1,
            codec=codec.get_config(),
            tables=(table,),
            files=files,
        )
        store.write_atomic(store.step_path(step, MANIFEST_NAME), manifest.to_json().encode())
        parent = step
    return base, diff, diff_rows


@pytest.mark.parametrize("codec_id", ["raw", "test_delta"])
def test_delta_codec_files_are_added_in_chain_order(tmp_path: Path, codec_id: str) -> None:
    from embckpt.read.export import reconstruct

    base, diff, rows = _write_chain(tmp_path, codec_id)
    expected = base.clone()
    if codec_id == "test_delta":
        expected[torch.from_numpy(rows)] += diff
    else:
        expected[torch.from_numpy(rows)] = diff
    restored = reconstruct(tmp_path)
    assert restored.chain == (1, 2)
    assert torch.equal(restored.tables["embedding_bags.t.weight"], expected)


def test_incomplete_chain_names_what_is_missing(tmp_path: Path) -> None:
    from embckpt.errors import ChainIncompleteError
    from embckpt.read.export import reconstruct

    _write_chain(tmp_path, "raw")
    (tmp_path / "step_000000000001" / "MANIFEST.json").unlink()
    with pytest.raises(ChainIncompleteError) as caught:
        reconstruct(tmp_path, 2)
    message = str(caught.value)
    assert "step_000000000001" in message and "step 1 is missing" in message
    assert "parent of step 2" in message and "committed steps: 2" in message


def test_manifests_without_the_new_fields_still_read() -> None:
    from embckpt.storage import manifest as manifest_module
    from embckpt.storage.manifest import FileEntry, Manifest

    old = Manifest(
        step=3,
        kind="full",
        policy="full",
        base_step=3,
        parent_step=None,
        world_size=1,
        codec={"id": "raw"},
        tables=(),
        files=(FileEntry("tables/t/r0_c0.p0.parquet", 10, "ab" * 32, "rows", 0, "t"),),
    )
    body = json.loads(old.to_json())
    for entry in body["files"]:
        del entry["fqn"], entry["index"]
    del body["checksum"]
    body["checksum"] = manifest_module._checksum(body)
    parsed = Manifest.from_json(json.dumps(body), "m")
    assert parsed == old and parsed.files[0].index is None


def test_an_index_serves_only_the_file_it_describes() -> None:
    from embckpt.storage.manifest import FileEntry, FileIndex

    index = FileIndex(file_checksum="aa" * 32, footer_offset=4, footer_checksum="cc" * 32)
    entry = FileEntry("tables/t/r0_c0.p0.parquet", 10, "aa" * 32, "rows", 0, "t", index=index)
    assert entry.partial_index is index
    # e.g. a file rewritten by a merge whose entry kept the old index: read whole instead
    assert replace(entry, checksum="bb" * 32).partial_index is None
