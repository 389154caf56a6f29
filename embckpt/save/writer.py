"""Row files: staged units encoded and written as Parquet, several at a time.

Encoding (the codec, pyarrow), hashing and file I/O release the GIL, so a small thread pool
writes one file per unit in parallel. Delta codecs (``delta``, ``exponent``) encode against the
writer's :class:`~embckpt.save.reference.ReconstructedRows`: full checkpoints go through the
whole-row codec (``delta``'s inner one, or the base codec for ``exponent``) and reset it,
incremental diffs add their decoded deltas to it, one-shot diffs leave it at the base.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import numpy as np
import torch

from embckpt.codecs import Codec, DeltaCodec, EncodedRows
from embckpt.policy import Decision, Kind
from embckpt.save.reference import ReconstructedRows
from embckpt.save.snapshot import StagedUnit
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import FileEntry
from embckpt.storage.phases import timed
from embckpt.storage.shardfile import encode_file, index_file, row_state_columns
from embckpt.tracking import View


@dataclass(frozen=True)
class _Part:
    """What one file of a unit holds: ``picked`` rows of the unit (None: all), encoded."""

    codec: Codec
    encoded: EncodedRows
    picked: np.ndarray | None = None
    suffix: str = ""


class RowFileWriter:
    """Writes staged units of one rank; ``close()`` when done.

    Args:
        store: the checkpoint directory.
        state_codec: codec of optimizer state (element-wise; row-wise too when lossy;
            lossless by default).
        base_codec: codec of full checkpoints when the row codec is a delta codec.
        rank: this rank (recorded in each file's manifest entry).
        row_group_rows: Parquet row-group size.
        threads: files encoded and written at once.
        track_chain: one-shot diffs may be followed by incremental ones (delta codecs then
            keep what each one-shot diff reconstructs).
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        state_codec: Codec,
        base_codec: Codec,
        rank: int,
        row_group_rows: int,
        threads: int,
        track_chain: bool = False,
    ) -> None:
        self.store = store
        self.state_codec = state_codec
        self.base_codec = base_codec
        self.rank = rank
        self.row_group_rows = row_group_rows
        self.track_chain = track_chain
        self.reference = ReconstructedRows()
        self._io = concurrent.futures.ThreadPoolExecutor(threads, "embckpt-io")

    def write(
        self, step: int, staged: list[StagedUnit], decision: Decision, codec: Codec
    ) -> list[FileEntry]:
        """Encodes with ``codec`` and writes every unit of ``staged`` as files of ``step``
        (one per unit; two for a ``delta`` diff with rows better written whole)."""
        written = self._io.map(lambda unit: self._timed_write(step, unit, decision, codec), staged)
        return [entry for entries in written for entry in entries]

    def _timed_write(
        self, step: int, block: StagedUnit, decision: Decision, codec: Codec
    ) -> list[FileEntry]:
        # What _write spends outside its encode, write and fsync phases is checksumming (the
        # file's and its row groups' for the index): counted as "hash".
        with timed(self.store.clock, "hash"):
            with timed(self.store.clock, "encode"):
                parts = self._encode(step, block, decision, codec)
            return [self._write(step, block, part) for part in parts]

    def _encode(
        self, step: int, block: StagedUnit, decision: Decision, codec: Codec
    ) -> list[_Part]:
        """Encodes a unit's rows; delta codecs encode against, and update, the reconstruction."""
        if not codec.delta:
            return [_Part(codec, codec.encode(block.weights))]
        shard = block.unit.shard
        key, rows, cols = shard.key, block.local_rows, shard.num_cols
        if decision.kind is Kind.FULL:
            base = codec.whole if isinstance(codec, DeltaCodec) else self.base_codec
            encoded = base.encode(block.weights)
            self.reference.set_base(step, key, (shard.num_rows, cols), rows, base, encoded)
            return [_Part(base, encoded)]
        one_shot = decision.view is View.SINCE_FULL
        if one_shot and self.track_chain:
            self.reference.reset_chain(step)
        reference = self.reference.rows(key, rows, chain=not one_shot)
        # The chain goes on from this diff: incremental diffs always, one-shot ones when
        # incremental diffs may follow (the policy mixes them).
        chained = not one_shot or self.track_chain
        if not isinstance(codec, DeltaCodec):
            encoded = codec.encode(block.weights.float().cpu() - reference)
            if chained:
                self.reference.replace(key, rows, reference + codec.decode(encoded, cols))
            return [_Part(codec, encoded)]
        split = codec.encode_split(block.weights, reference)
        parts = []
        if len(split.delta_rows):
            parts.append(_Part(codec, split.delta, split.delta_rows))
            if chained:
                at = torch.from_numpy(split.delta_rows)
                rebuilt = reference[at] + codec.decode(split.delta, cols)
                self.reference.replace(key, rows[at], rebuilt)
        if split.whole is not None:
            parts.append(_Part(codec.whole, split.whole, split.whole_rows, ".whole"))
            if chained:
                at = torch.from_numpy(split.whole_rows)
                self.reference.replace(key, rows[at], codec.whole.decode(split.whole, cols))
        return parts

    def _write(self, step: int, block: StagedUnit, part: _Part) -> FileEntry:
        shard = block.unit.shard
        picked = None if part.picked is None else torch.from_numpy(part.picked)
        local_rows = block.local_rows if picked is None else block.local_rows[picked]
        row_states, elem_states = block.row_states, block.elem_states
        if picked is not None:
            row_states = {n: t[picked.to(t.device)] for n, t in row_states.items()}
            elem_states = {n: t[picked.to(t.device)] for n, t in elem_states.items()}
        global_rows = (local_rows + shard.row_offset).numpy()
        with timed(self.store.clock, "encode"):
            data = encode_file(
                rows=global_rows,
                encoded=part.encoded,
                row_states=row_state_columns(self.state_codec, row_states),
                elem_states={n: self.state_codec.encode(t) for n, t in elem_states.items()},
                metadata={
                    "table": shard.table,
                    "row_offset": shard.row_offset,
                    "col_offset": shard.col_offset,
                    "cols": shard.num_cols,
                    "codec": part.codec.get_config(),
                    "state_codec": self.state_codec.get_config(),
                },
                row_group_rows=self.row_group_rows,
            )
        block_name = f"r{shard.row_offset}_c{shard.col_offset}.p{block.unit.part}{part.suffix}"
        index = index_file(data)  # one CRC32C pass: row groups, footer, whole file
        written = self.store.write_file(
            step, f"tables/{shard.table}/{block_name}.parquet", data, index.file_checksum
        )
        return FileEntry(
            path=written.path,
            bytes=written.bytes,
            checksum=written.checksum,
            role="rows",
            rank=self.rank,
            table=shard.table,
            row_offset=shard.row_offset,
            col_offset=shard.col_offset,
            shard_rows=shard.num_rows,
            shard_cols=shard.num_cols,
            rows=len(global_rows),
            fqn=shard.fqn,
            index=index,
        )

    def close(self) -> None:
        self._io.shutdown(wait=True)
