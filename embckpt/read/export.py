"""Export a checkpoint for readers that do not use embckpt, without the model that wrote it.

* ``dcp``: a standard ``torch.distributed.checkpoint`` directory whose keys are those of
  ``dmp.state_dict()`` (``sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight``
  and the dense modules' keys). Tables are saved unsharded; DCP reshards on load, so
  ``dcp.load(dmp.state_dict(), checkpoint_id=OUT)`` fills a DMP of any world size and plan.
* ``safetensors``: one file with one unsharded tensor per table plus the dense keys, loadable
  with ``load_state_dict`` into the single-process model (e.g. ``DLRM``); with
  ``tables_only`` the keys are the ``EmbeddingBagCollection``'s own
  (``embedding_bags.<table>.weight``), for serving or transfer learning.

One process rebuilds the tables (the chain applied in order, as a restore does) and holds them
whole in memory. Optimizer state is not exported: the formats are for loading models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embckpt import dense
from embckpt.blocks import TableShard
from embckpt.dtypes import dtype_from_name
from embckpt.read.apply import read_into
from embckpt.storage.chain import read_chain
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import Manifest

DEFAULT_TABLE_PREFIX = "sparse_arch.embedding_bag_collection.embedding_bags."
"""Where a table's weight sits in ``dmp.state_dict()`` when the manifest does not say (an entry
without ``fqn``, which format 1 allows): the reference DLRM's collection."""
_EBC_MARKER = "embedding_bags."


@dataclass(frozen=True)
class Reconstructed:
    """A checkpoint rebuilt in one process.

    Attributes:
        step: the checkpoint.
        chain: the steps applied, base first.
        tables: full table weights by their key in the writer's ``model.state_dict()``.
        dense: every other entry of the writer's ``model.state_dict()``.
    """

    step: int
    chain: tuple[int, ...]
    tables: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The writer's ``model.state_dict()`` with every table whole."""
        return {**self.dense, **self.tables}


def reconstruct(
    directory: str | Path,
    step: int | None = None,
    *,
    threads: int | None = None,
    progress: bool = False,
    table_prefix: str = DEFAULT_TABLE_PREFIX,
) -> Reconstructed:
    """Rebuilds checkpoint ``step`` (the latest if None) of ``directory`` whole.

    Raises:
        ChainIncompleteError: no committed checkpoint, or a link of the chain is missing.
        CheckpointCorruptError: a file is missing, truncated or altered (named).
    """
    store = CheckpointStore(directory)
    chain = read_chain(store, step)
    step = chain[-1].step
    head = chain[-1]
    fqns = _table_keys(head, table_prefix)
    shards = [
        TableShard(
            table=t.name,
            fqn=fqns[t.name],
            sharding_type="unsharded",
            row_offset=0,
            col_offset=0,
            table_rows=t.rows,
            table_cols=t.cols,
            weight=torch.zeros(t.rows, t.cols, dtype=dtype_from_name(t.dtype)),
        )
        for t in head.tables
    ]
    read_into(store, chain, shards, threads=threads, progress=progress)
    dense_entry = next(f for f in head.files if f.role == "dense")
    state = dense.decode_tree(store.read_checked(step, dense_entry.written).to_pybytes())
    return Reconstructed(
        step=step,
        chain=tuple(m.step for m in chain),
        tables={s.fqn: s.weight for s in shards},
        dense=dict(state["model"]),
    )


def _table_keys(head: Manifest, prefix: str) -> dict[str, str]:
    keys = {t.name: f"{prefix}{t.name}.weight" for t in head.tables}
    for entry in head.files:
        if entry.role == "rows" and entry.fqn:
            keys[entry.table] = entry.fqn
    return keys


def export_dcp(
    directory: str | Path, out: str | Path, step: int | None = None, **options: Any
) -> Reconstructed:
    """Writes checkpoint ``step`` as a ``torch.distributed.checkpoint`` directory ``out``.

    Runs in one process (no process group needed, none used if one exists). ``options`` go to
    :func:`reconstruct`.
    """
    import torch.distributed.checkpoint as dcp

    model = reconstruct(directory, step, **options)
    dcp.save(model.state_dict(), checkpoint_id=str(out), no_dist=True)
    return model


def export_safetensors(
    directory: str | Path,
    out: str | Path,
    step: int | None = None,
    *,
    tables_only: bool = False,
    **options: Any,
) -> Reconstructed:
    """Writes checkpoint ``step`` as one safetensors file ``out``.

    Args:
        directory: the checkpoint directory.
        out: the file to write.
        step: the checkpoint; the latest if None.
        tables_only: only the tables, keyed as in an ``EmbeddingBagCollection``
            (``embedding_bags.<table>.weight``); otherwise the whole model's state dict.
        options: passed to :func:`reconstruct`.
    """
    import safetensors.torch

    model = reconstruct(directory, step, **options)
    if tables_only:
        state = {_ebc_key(key): value for key, value in model.tables.items()}
    else:
        state = model.state_dict()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    metadata = {"embckpt.step": str(model.step), "embckpt.chain": ",".join(map(str, model.chain))}
    contiguous = {k: v.contiguous() for k, v in state.items()}
    safetensors.torch.save_file(contiguous, str(out), metadata=metadata)
    return model


def _ebc_key(key: str) -> str:
    at = key.rfind(_EBC_MARKER)
    return key[at:] if at >= 0 else key
