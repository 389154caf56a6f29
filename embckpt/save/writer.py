"""Row files: staged units encoded and written as Parquet, several at a time.

Encoding (the codec, pyarrow), hashing and file I/O release the GIL, so a small thread pool
writes one file per unit in parallel. Additive codecs (``delta``, ``exponent``) encode against the
writer's :class:`~embckpt.save.reference.ReconstructedRows`: full checkpoints go through the
whole-row codec (``delta``'s inner one, or the base codec for ``exponent``) and rebuild it,
incremental diffs add their decoded deltas to it, one-shot diffs leave it at the base. A diff's
changes to it go to the save's :class:`WriteEdits`, applied only once the checkpoint commits.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import numpy as np
import torch

from embckpt import failpoints
from embckpt.codecs import Codec, DeltaCodec, EncodedRows
from embckpt.policy import Decision, Kind
from embckpt.save.capture import CapturedRows, CaptureEdit
from embckpt.save.reference import ReconstructedRows, ReferenceEdit
from embckpt.save.snapshot import StagedUnit
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import rows_file
from embckpt.storage.manifest import FileEntry
from embckpt.storage.phases import PhaseClock
from embckpt.storage.rowfile_write import encode_file, index_file, row_state_columns


@dataclass(frozen=True)
class WriteEdits:
    """Where one save's writes record their changes to state outside the files.

    Attributes:
        reference: a diff of an additive codec: what its rows now reconstruct as (None otherwise:
            a full rebuilds the reference in place, see ``save/reference.py``).
        capture: what each file restores to, when the writer's reconstruction is tracked.
    """

    reference: ReferenceEdit | None = None
    capture: CaptureEdit | None = None


@dataclass(frozen=True)
class _Part:
    """What one file of a unit holds: ``picked`` rows of the unit (None: all), encoded;
    ``restored``: the fp32 rows a restore gives, when decoded (a diff the chain goes on from,
    or the capture)."""

    codec: Codec
    encoded: EncodedRows
    picked: np.ndarray | None = None
    whole: bool = False  # a delta diff's rows better written whole: a sibling file
    restored: torch.Tensor | None = None


class RowFileWriter:
    """Writes staged units of one rank; ``close()`` when done.

    Args:
        store: the checkpoint directory.
        state_codec: codec of optimizer state (element-wise; row-wise too when lossy;
            lossless by default).
        base_codec: codec of full checkpoints when the row codec is an additive codec.
        rank: this rank (recorded in each file's manifest entry).
        row_group_rows: Parquet row-group size.
        threads: files encoded and written at once.
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
    ) -> None:
        self.store = store
        self.state_codec = state_codec
        self.base_codec = base_codec
        self.rank = rank
        self.row_group_rows = row_group_rows
        self.reference = ReconstructedRows()
        self._io = concurrent.futures.ThreadPoolExecutor(threads, "embckpt-io")

    def write(
        self,
        step: int,
        staged: list[StagedUnit],
        decision: Decision,
        codec: Codec,
        edits: WriteEdits,
        clock: PhaseClock,
    ) -> list[FileEntry]:
        """Encodes with ``codec`` and writes every unit of ``staged`` as files of ``step``
        (one per unit; two for a ``delta`` diff with rows better written whole); ``clock``
        gets the save's ``encode``, ``hash``, ``write`` and ``fsync`` time."""
        written = self._io.map(
            lambda unit: self._timed_write(step, unit, decision, codec, edits, clock), staged
        )
        return [entry for entries in written for entry in entries]

    def _timed_write(
        self,
        step: int,
        unit: StagedUnit,
        decision: Decision,
        codec: Codec,
        edits: WriteEdits,
        clock: PhaseClock,
    ) -> list[FileEntry]:
        # What _write spends outside its encode, write and fsync phases is checksumming (the
        # file's and its row groups' for the index): counted as "hash".
        with clock.time("hash"):
            failpoints.hit("save.encode")
            with clock.time("encode"):
                parts = self._encode(unit, decision, codec, edits)
            failpoints.hit("save.write")
            return [self._write(step, unit, part, edits.capture, clock) for part in parts]

    def _encode(
        self, unit: StagedUnit, decision: Decision, codec: Codec, edits: WriteEdits
    ) -> list[_Part]:
        """Encodes a unit's rows; additive codecs encode against the reconstruction, and a diff
        records in ``edits.reference`` what its rows reconstruct as."""
        capture = edits.capture is not None
        cols = unit.unit.shard.num_cols
        if not codec.additive:
            encoded = codec.encode(unit.weights)
            return [_Part(codec, encoded, restored=_decoded(codec, encoded, cols, capture))]
        shard = unit.unit.shard
        key, rows = shard.key, unit.local_rows
        if decision.kind is Kind.FULL:
            base = codec.whole if isinstance(codec, DeltaCodec) else self.base_codec
            encoded = base.encode(unit.weights)
            self.reference.set_base(key, (shard.num_rows, cols), rows, base, encoded)
            return [_Part(base, encoded, restored=_decoded(base, encoded, cols, capture))]
        one_shot = decision.one_shot
        reference = self.reference.rows(key, rows, chain=not one_shot)
        # The chain goes on from this diff (edits.reference is set): incremental diffs always,
        # one-shot ones when incremental diffs may follow (the policy mixes them).
        edit = edits.reference
        # What the rows restore to is decoded only when the chain goes on or it is captured.
        rebuild = edit is not None or capture
        if not isinstance(codec, DeltaCodec):
            encoded = codec.encode(unit.weights.float().cpu() - reference)
            restored = reference + codec.decode(encoded, cols) if rebuild else None
            if edit is not None and restored is not None:
                edit.replace(key, rows, restored)
            return [_Part(codec, encoded, restored=restored)]
        split = codec.encode_split(unit.weights, reference)
        parts = []
        if len(split.delta_rows):
            at = torch.from_numpy(split.delta_rows)
            rebuilt = reference[at] + codec.decode(split.delta, cols) if rebuild else None
            if edit is not None and rebuilt is not None:
                edit.replace(key, rows[at], rebuilt)
            parts.append(_Part(codec, split.delta, split.delta_rows, restored=rebuilt))
        if split.whole is not None:
            whole = _decoded(codec.whole, split.whole, cols, rebuild)
            if edit is not None and whole is not None:
                edit.replace(key, rows[torch.from_numpy(split.whole_rows)], whole)
            parts.append(_Part(codec.whole, split.whole, split.whole_rows, True, whole))
        return parts

    def _write(
        self,
        step: int,
        unit: StagedUnit,
        part: _Part,
        capture: CaptureEdit | None,
        clock: PhaseClock,
    ) -> FileEntry:
        shard = unit.unit.shard
        picked = None if part.picked is None else torch.from_numpy(part.picked)
        local_rows = unit.local_rows if picked is None else unit.local_rows[picked]
        row_states, elem_states = unit.row_states, unit.elem_states
        if picked is not None:
            row_states = {n: t[picked.to(t.device)] for n, t in row_states.items()}
            elem_states = {n: t[picked.to(t.device)] for n, t in elem_states.items()}
        global_rows = (local_rows + shard.row_offset).numpy()
        with clock.time("encode"):
            row_columns = row_state_columns(self.state_codec, row_states)
            elem_columns = {n: self.state_codec.encode(t) for n, t in elem_states.items()}
            data = encode_file(
                rows=global_rows,
                encoded=part.encoded,
                row_states=row_columns,
                elem_states=elem_columns,
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
        if capture is not None:
            capture.add(self._captured(unit, part, local_rows, row_columns, elem_columns))
        name = rows_file(
            shard.table, shard.row_offset, shard.col_offset, unit.unit.part, part.whole
        )
        index = index_file(data)  # one CRC32C pass: row groups, footer, whole file
        written = self.store.write_file(step, name, data, index.file_checksum, clock=clock)
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

    def _captured(
        self,
        unit: StagedUnit,
        part: _Part,
        local_rows: torch.Tensor,
        row_columns: dict[str, np.ndarray | EncodedRows],
        elem_columns: dict[str, EncodedRows],
    ) -> CapturedRows:
        """What this file restores to, decoded as a reader decodes it (debug capture)."""
        shard = unit.unit.shard
        assert part.restored is not None  # decoded for every part when capturing
        values = {"weight": part.restored.float().cpu()}
        for name, column in row_columns.items():
            if isinstance(column, np.ndarray):
                values[f"row:{name}"] = torch.from_numpy(column.copy()).float()
            else:
                values[f"row:{name}"] = self.state_codec.decode(column, 1).reshape(-1).float()
        for name, encoded in elem_columns.items():
            values[f"elem:{name}"] = self.state_codec.decode(encoded, shard.num_cols).float()
        return CapturedRows(shard.key, shard.num_rows, local_rows.cpu(), values)

    def close(self) -> None:
        self._io.shutdown(wait=True)


def _decoded(codec: Codec, encoded: EncodedRows, cols: int, wanted: bool) -> torch.Tensor | None:
    """The rows ``encoded`` restores to, when the caller captures them."""
    return codec.decode(encoded, cols).float() if wanted else None
