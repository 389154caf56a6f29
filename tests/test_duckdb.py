"""The README's DuckDB query, run as written on a real 2-rank checkpoint whose small blocks are
packed into shared files and whose larger ones have files of their own: every table's rows
come back as row ids and FLOAT[] embeddings equal to the model's weights."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import duckdb
import numpy as np
import toy_model as tm
from shard_compare import assemble, blocks

from embckpt.examples.launcher import run_ranks

README = Path(__file__).parents[1] / "README.md"
STEP = 4
EXAMPLE_DIR = "ckpts/step_000000000004"
EXAMPLE_TABLE = "sparse_arch.embedding_bag_collection.t_cw"


def _save_full(rank: int, world_size: int, root: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer

    model, opt = tm.build(world_size, seed=0)
    # Blocks under 8 KiB packed (the toy's blocks are 5-10 KiB): some packed, some alone.
    config = CheckpointConfig(
        policy="full", pipeline="off", row_group_rows=32, entropy="zstd", pack_below_bytes=8192
    )
    with Checkpointer(model, f"{root}/ckpts", optimizer=opt, config=config) as ckpt:
        for step in range(1, STEP + 1):
            tm.train_step(model, opt, step, rank, hot=80)
        ckpt.save(STEP).wait()
    return blocks(model, opt, rank)


def _readme_query() -> str:
    text = README.read_text()
    found = re.findall(r"```sql\n(.*?)```", text, flags=re.DOTALL)
    assert len(found) == 1 and EXAMPLE_DIR in found[0] and EXAMPLE_TABLE in found[0], (
        "README: one sql block on t_cw"
    )
    return found[0]


def test_readme_duckdb_query_reads_every_table_of_a_checkpoint() -> None:
    query = _readme_query()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_save_full, 2, root)
        truth = assemble(per_rank)
        assert set(truth) == {tm.table(k) for k in tm.KINDS}
        step = Path(root) / "ckpts" / f"step_{STEP:012d}"
        assert list(step.glob("packed/*.parquet")) and list(step.glob("tables/*/*.parquet"))
        for table, arrays in truth.items():
            relation = duckdb.sql(
                query.replace(EXAMPLE_DIR, str(step)).replace(EXAMPLE_TABLE, table)
            )
            assert [str(t) for t in relation.types] == ["BIGINT", "FLOAT[]"], table
            rows = relation.fetchall()
            ids = np.array([r[0] for r in rows])
            embeddings = np.array([r[1] for r in rows], dtype=np.float32)
            np.testing.assert_array_equal(ids, np.arange(tm.ROWS), err_msg=table)
            np.testing.assert_array_equal(embeddings, arrays["weight"], err_msg=table)
