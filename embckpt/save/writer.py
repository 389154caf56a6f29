"""Row files: staged units encoded and written as Parquet, several at a time.

Encoding (the codec, pyarrow), hashing and file I/O release the GIL, so a small thread pool
encodes units and writes files in parallel: one file per large block, written by the thread
that encoded it as soon as it is encoded, so a unit's encoded columns live only while its file
streams into the store (``storage/sink.py``); small blocks are packed into shared files
(``pack_below_bytes``) once every unit of the piece is encoded. What the columns hold beyond
views of the staging arena is counted against the staging budget (``save/staging.py``).

Additive codecs (``delta``, ``exponent``) encode against the writer's
:class:`~embckpt.save.reference.ReconstructedRows`: full checkpoints go through the whole-row
codec (``delta``'s inner one, or the base codec for ``exponent``) and rebuild it, incremental
diffs add their decoded deltas to it, one-shot diffs leave it at the base. A diff's changes to
it go to the save's :class:`WriteEdits`, applied only once the checkpoint commits.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

from embckpt import failpoints
from embckpt.blocks import TableShard
from embckpt.codecs import Codec, DeltaCodec, EncodedRows
from embckpt.codecs.common import binary_payload
from embckpt.config import CheckpointConfig
from embckpt.policy import Decision, DiffBase, Kind
from embckpt.save.capture import CapturedRows, CaptureEdit
from embckpt.save.reference import ReconstructedRows, ReferenceEdit
from embckpt.save.snapshot import StagedUnit, sample_unit
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import packed_rows_file, rows_file
from embckpt.storage.manifest import FileEntry, FileIndex
from embckpt.storage.phases import PhaseClock
from embckpt.storage.rowfile_write import (
    BlockColumns,
    RowsFile,
    block_columns,
    block_indexes,
    row_state_columns,
)


class Staging(Protocol):
    """What counts the encoded buffers a write holds (``StagingArena``, ``SlabPool``)."""

    def hold(self, nbytes: int) -> None: ...

    def release(self, nbytes: int) -> None: ...

    def owns(self, address: int) -> bool:
        """Whether ``address`` lies in the staged rows (a view the codec did not copy)."""
        ...


log = logging.getLogger(__name__)


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


PACK_BELOW_BYTES: int = CheckpointConfig.pack_below_bytes
"""Blocks encoded smaller than this share packed files (see :class:`RowFileWriter`)."""
PACKED_FILE_BYTES = 64 << 20  # a packed file is closed once its blocks reach this size


@dataclass(frozen=True)
class _Block:
    """One file's worth of one unit's rows, encoded into columns, not written yet."""

    unit: StagedUnit
    part: _Part
    columns: BlockColumns
    rows: int
    held: int  # bytes of its columns outside the staging arena (counted while held)


class RowFileWriter:
    """Writes staged units of one rank; ``close()`` when done.

    Each unit is encoded into one block of columns (two for a ``delta`` diff with rows better
    written whole). Blocks of at least ``pack_below_bytes`` get a file each; smaller ones
    are *packed*: the blocks of one write with the same columns (names, types, compression)
    share one file, each in row groups of its own, up to ``PACKED_FILE_BYTES`` a file. The
    manifest lists each packed block on its own, with its row groups (``FileEntry.block``).

    Args:
        store: the checkpoint directory.
        state_codec: codec of optimizer state (element-wise; row-wise too when lossy;
            lossless by default).
        base_codec: codec of full checkpoints when the row codec is an additive codec.
        rank: this rank (recorded in each file's manifest entry).
        row_group_rows: Parquet row-group size.
        threads: files encoded and written at once.
        pack_below_bytes: blocks encoded smaller than this are packed (0: none is).
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
        pack_below_bytes: int = PACK_BELOW_BYTES,
    ) -> None:
        self.store = store
        self.state_codec = state_codec
        self.base_codec = base_codec
        self.rank = rank
        self.row_group_rows = row_group_rows
        self.pack_below_bytes = pack_below_bytes
        self.reference = ReconstructedRows()
        self.threads = threads
        self._io = concurrent.futures.ThreadPoolExecutor(threads, "embckpt-io")
        self._packs: dict[int, int] = {}  # step -> packed files written so far
        self._packs_lock = threading.Lock()
        # Set by the saver before each save: counts encoded buffers against the budget.
        self.staging: Staging | None = None

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
        (small blocks packed together, see the class doc); ``clock`` gets the save's
        ``encode``, ``hash``, ``write`` and ``fsync`` time. Returns once every file started is
        done, raising the first failure."""

        def encode_and_write(unit: StagedUnit) -> tuple[list[FileEntry], list[_Block]]:
            blocks = self._timed_encode(unit, decision, codec, edits, clock)
            entries: list[FileEntry] = []
            small = []
            try:
                for block in blocks:
                    if block.columns.nbytes < self.pack_below_bytes:
                        small.append(block)
                        continue
                    entries.extend(self._timed_write(step, [block], None, clock))
                    self._release([block])
            except BaseException:
                self._release(blocks)
                raise
            return entries, small

        done = self._all(encode_and_write, staged)
        small = [block for _, blocks in done for block in blocks]
        try:
            written = self._all(
                lambda file: self._timed_write(step, file[0], file[1], clock),
                self._files(small, step),
            )
        finally:
            self._release(small)
        return [e for entries, _ in done for e in entries] + [e for w in written for e in w]

    def _all(self, task: Any, items: list[Any]) -> list[Any]:
        """``task`` of every item on the pool; waits for all of them (a failed save must not
        leave a thread writing into the step folder it deletes), then raises the first error."""
        futures = [self._io.submit(task, item) for item in items]
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    def _release(self, blocks: list[_Block]) -> None:
        if self.staging is not None:
            self.staging.release(sum(b.held for b in blocks))

    def _held(self, columns: BlockColumns) -> int:
        """Bytes of ``columns`` outside the staging arena (counted against its budget)."""
        if self.staging is None:
            return 0
        arena = self.staging
        held = sum(
            buf.size
            for column in columns.table.columns
            for chunk in column.chunks
            for buf in _buffers(chunk)
            if not arena.owns(buf.address)
        )
        arena.hold(held)
        return held

    def _files(self, blocks: list[_Block], step: int) -> list[tuple[list[_Block], str | None]]:
        """The packed files to write: the small blocks by schema (a packed file's name; a
        pack of one block is written alone, named by its block)."""
        packs: dict[Any, list[list[_Block]]] = {}
        filled: dict[Any, int] = {}  # bytes in each schema's last run
        for block in blocks:
            size = block.columns.nbytes
            key = block.columns.schema_key
            runs = packs.setdefault(key, [[]])
            if runs[-1] and filled[key] + size > PACKED_FILE_BYTES:
                runs.append([])
                filled[key] = 0
            runs[-1].append(block)
            filled[key] = filled.get(key, 0) + size
        files: list[tuple[list[_Block], str | None]] = []
        for runs in packs.values():
            for run in runs:
                files.append((run, self._packed_name(step) if len(run) > 1 else None))
        return files

    def _packed_name(self, step: int) -> str:
        """A fresh packed file name in ``step`` (one save may write several pieces)."""
        with self._packs_lock:
            for old in [s for s in self._packs if s != step]:
                del self._packs[old]
            number = self._packs.get(step, 0)
            self._packs[step] = number + 1
        return packed_rows_file(self.rank, number)

    def _timed_encode(
        self,
        unit: StagedUnit,
        decision: Decision,
        codec: Codec,
        edits: WriteEdits,
        clock: PhaseClock,
    ) -> list[_Block]:
        # What is spent outside the encode phase (the capture) is counted as "hash".
        with clock.time("hash"):
            failpoints.hit("save.encode")
            with clock.time("encode"):
                parts = self._encode(unit, decision, codec, edits)
            return [self._block(unit, part, edits.capture, clock) for part in parts]

    def _timed_write(
        self, step: int, blocks: list[_Block], packed: str | None, clock: PhaseClock
    ) -> list[FileEntry]:
        # What _write spends outside its encode, write and fsync phases is checksumming (the
        # file's and its row groups' for the index): counted as "hash".
        with clock.time("hash"):
            failpoints.hit("save.write")
            return self._write(step, blocks, packed, clock)

    def _encode(
        self, unit: StagedUnit, decision: Decision, codec: Codec, edits: WriteEdits
    ) -> list[_Part]:
        """Encodes a unit's rows; additive codecs encode against the reconstruction, and a diff
        records in ``edits.reference`` what its rows reconstruct as."""
        capture = edits.capture is not None
        cols = unit.unit.shard.num_cols
        if not codec.additive:
            encoded = _whole(codec, unit)
            return [_Part(codec, encoded, restored=_decoded(codec, encoded, cols, capture))]
        shard = unit.unit.shard
        key, rows = shard.key, unit.local_rows
        if decision.kind is Kind.FULL:
            base = codec.whole if isinstance(codec, DeltaCodec) else self.base_codec
            encoded = _whole(base, unit)
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
            # Beside delta rows, a binary payload compressed as theirs: both share the packed
            # file (a file per link and rank for a restore to open, not two).
            encoded = split.whole
            if parts:
                encoded = binary_payload(split.whole, self.pack_below_bytes, like=split.delta)
            parts.append(_Part(codec.whole, encoded, split.whole_rows, True, whole))
        return parts

    def _block(
        self,
        unit: StagedUnit,
        part: _Part,
        capture: CaptureEdit | None,
        clock: PhaseClock,
    ) -> _Block:
        """A part's rows and optimizer states as the columns of a rows file."""
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
            columns = block_columns(
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
            )
        if capture is not None:
            capture.add(self._captured(unit, part, local_rows, row_columns, elem_columns))
        return _Block(unit, part, columns, len(global_rows), self._held(columns))

    def _write(
        self, step: int, blocks: list[_Block], packed: str | None, clock: PhaseClock
    ) -> list[FileEntry]:
        """Writes one file: a block alone (``packed`` None) or several packed under the name
        ``packed``; returns the manifest entry of each block."""
        # Parquet encoding streams into the file: the time the sink does not count as its
        # write or its CRC (hash) is the encoding's.
        data = RowsFile([b.columns for b in blocks], self.row_group_rows, packed is not None)
        if packed is None:
            unit, part = blocks[0].unit.unit, blocks[0].part
            shard = unit.shard
            name = rows_file(shard.table, shard.row_offset, shard.col_offset, unit.part, part.whole)
        else:
            name = packed
        with clock.time("encode"):
            written = self.store.write_file(step, name, data, clock=clock)
        assert data.index is not None  # set by the complete write
        indexes: list[FileIndex] = (
            [data.index] if packed is None else block_indexes(data.index, [b.rows for b in blocks])
        )
        return [
            FileEntry(
                path=written.path,
                bytes=written.bytes,
                checksum=written.checksum,
                role="rows",
                rank=self.rank,
                table=block.unit.unit.shard.table,
                row_offset=block.unit.unit.shard.row_offset,
                col_offset=block.unit.unit.shard.col_offset,
                shard_rows=block.unit.unit.shard.num_rows,
                shard_cols=block.unit.unit.shard.num_cols,
                rows=block.rows,
                fqn=block.unit.unit.shard.fqn,
                index=block_index,
                block=None if packed is None else number,
                digest=written.digest,
            )
            for number, (block, block_index) in enumerate(zip(blocks, indexes, strict=True))
        ]

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

    def warm(self, codec: Codec, shards: list[TableShard]) -> None:
        """Encodes a full and a diff of a few rows of each block layout of ``shards`` with
        ``codec``, as a save would, writing nothing and keeping no reference: the compiled
        kernels this needs (numba's, loaded from its disk cache or compiled) are then ready
        before the first save, whose window would otherwise wait for them. A failure is only
        logged: a save that needs what this could not ready compiles it then, and reports its
        own errors."""
        try:
            self._warm(codec, shards)
        except Exception as exc:
            log.warning("could not ready the codec's kernels before the first save: %s", exc)

    def _warm(self, codec: Codec, shards: list[TableShard]) -> None:
        codecs = json.dumps(
            [c.get_config() for c in (codec, self.state_codec, self.base_codec)],
            sort_keys=True,
            default=str,
        )
        layouts = {(codecs, _layout(shard)): shard for shard in shards if shard.num_rows}
        reference, staging = self.reference, self.staging
        self.reference, self.staging = ReconstructedRows(), None
        try:
            for key, shard in layouts.items():
                if key in _WARMED:
                    continue
                unit = sample_unit(shard)
                for decision in (Decision(Kind.FULL), Decision(Kind.DIFF, DiffBase.LAST_FULL)):
                    if decision.kind is Kind.DIFF:
                        unit = dataclasses.replace(unit, weights=unit.weights * 1.5 + 0.01)
                    parts = self._encode(unit, decision, codec, WriteEdits())
                    for part in parts:
                        self._block(unit, part, None, PhaseClock())
                _WARMED.add(key)
        finally:
            self.reference, self.staging = reference, staging

    def close(self) -> None:
        self._io.shutdown(wait=True)


# What warm() already ran in this process (codecs and block layout): a kernel, once loaded,
# stays loaded, so a job's next Checkpointer (a restore into a fresh one, a test's next case)
# does not encode the samples again.
_WARMED: set[tuple[str, tuple[Any, ...]]] = set()


def _layout(shard: TableShard) -> tuple[Any, ...]:
    """What decides the kernels a block's encoding runs: its columns and tensors' types."""
    states = [(n, t.dtype, tuple(t.shape[1:])) for n, t in sorted(shard.row_states.items())]
    elems = [(n, t.dtype) for n, t in sorted(shard.elem_states.items())]
    return shard.num_cols, shard.weight.dtype, tuple(states), tuple(elems)


def _whole(codec: Codec, unit: StagedUnit) -> EncodedRows:
    """Whole rows encoded: from the fused rows the device quantized (the bytes the codec's
    CPU path writes, ``codecs/device_encode.py``), else from the staged fp32 rows."""
    if unit.fused is not None:
        return codec.encode_fused(unit.fused, True)
    return codec.encode(unit.weights)


def _decoded(codec: Codec, encoded: EncodedRows, cols: int, wanted: bool) -> torch.Tensor | None:
    """The rows ``encoded`` restores to, when the caller captures them."""
    return codec.decode(encoded, cols).float() if wanted else None


def _buffers(array: pa.Array) -> list[pa.Buffer]:
    """The memory of an Arrow array: its buffers, a dictionary array's indices and values."""
    if isinstance(array, pa.DictionaryArray):
        return _buffers(array.indices) + _buffers(array.dictionary)
    return [buf for buf in array.buffers() if buf is not None]
