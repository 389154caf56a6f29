"""The reconstructed rows that additive codecs encode against (LC-Checkpoint's error feedback).

An additive codec writes ``rows - reference``, where ``reference`` is what a restore of the chain
reproduces for those rows so far; the quantization error of one checkpoint then feeds into the
next delta instead of piling up. The writer keeps that reference for the blocks it writes, and
nothing is read back from storage:

- the base: the full checkpoint's *encoded* rows, as its files hold them (a 4-bit row of 64
  values is 36 bytes instead of 256 in fp32), decoded only for the rows a diff writes;
- an overlay: fp32 rows that incremental diffs changed since the full (their base plus the
  deltas written since), allocated as such diffs come; one-shot diffs take their deltas
  against the base alone and leave the reference there, unless incremental diffs may follow
  them (``Policy.mixes_diffs``): then they restart the overlay with what they reconstruct.

A full checkpoint resets both. After a restart or a restore there is no reference until the
next full (the checkpointer takes one).

Saves are transactions (:mod:`embckpt.save.transaction`): a diff's changes to the overlay are
kept aside in a :class:`ReferenceEdit` and applied only once its checkpoint commits, so a
failed diff leaves the reference as the last committed checkpoint left it. A full builds its
base in place: keeping the previous base until the commit would double the reference's memory
for every full, so a failed full clears the reference instead, and the next save is a full.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from embckpt.codecs import Codec, EncodedRows


@dataclass(frozen=True)
class _BaseRows:
    """One file's worth of a full checkpoint's rows of a block: sorted local rows, encoded."""

    rows: np.ndarray
    codec: Codec
    encoded: EncodedRows


class _Overlay:
    """fp32 rows of one block that incremental deltas changed: a slot per block row, the rows
    in a buffer grown by doubling."""

    def __init__(self, num_rows: int, cols: int) -> None:
        self.slot = np.full(num_rows, -1, dtype=np.int64)
        self.values = torch.empty((0, cols), dtype=torch.float32)
        self.used = 0

    def put(self, rows: np.ndarray, values: torch.Tensor) -> None:
        new = rows[self.slot[rows] < 0]
        if len(new):
            if self.used + len(new) > len(self.values):
                size = max(2 * len(self.values), self.used + len(new))
                grown = torch.empty((size, values.shape[1]), dtype=torch.float32)
                grown[: self.used] = self.values[: self.used]
                self.values = grown
            self.slot[new] = np.arange(self.used, self.used + len(new))
            self.used += len(new)
        self.values[torch.from_numpy(self.slot[rows])] = values


class ReconstructedRows:
    """Per block, what a restore of the latest chain reproduces; host memory only."""

    def __init__(self) -> None:
        self._base: dict[str, list[_BaseRows]] = {}
        self._shapes: dict[str, tuple[int, int]] = {}
        self._overlay: dict[str, _Overlay] = {}
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """True once a full checkpoint set the base (false at start and after a restore)."""
        return bool(self._base)

    def clear(self) -> None:
        with self._lock:
            self._base.clear()
            self._shapes.clear()
            self._overlay.clear()

    def begin_full(self) -> None:
        """A full checkpoint starts: the previous base is dropped now (see the module's
        docstring for why a failed full then clears the reference rather than restoring it)."""
        self.clear()

    def set_base(
        self,
        key: str,
        shape: tuple[int, int],
        local_rows: torch.Tensor,
        codec: Codec,
        encoded: EncodedRows,
    ) -> None:
        """Rows ``local_rows`` (sorted) of block ``key`` (``shape``) are now what ``encoded``
        decodes to: part of the full checkpoint being written."""
        # Columns may alias the staged rows (``raw`` wraps their bytes), which the next
        # checkpoint reuses: the reference keeps its own copy.
        owned = EncodedRows(
            {name: pa.concat_arrays([c, c.slice(0, 0)]) for name, c in encoded.columns.items()},
            encoded.metadata,
        )
        part = _BaseRows(local_rows.cpu().numpy(), codec, owned)
        with self._lock:
            self._base.setdefault(key, []).append(part)
            self._shapes[key] = shape

    def rows(self, key: str, local_rows: torch.Tensor, chain: bool = True) -> torch.Tensor:
        """The reconstruction of rows ``local_rows`` (sorted) of block ``key``, fp32 [n, cols]:
        of the chain so far, or with ``chain=False`` of the base full alone."""
        wanted = local_rows.cpu().numpy()
        with self._lock:
            parts = list(self._base.get(key, ()))
            overlay = self._overlay.get(key) if chain else None
            shape = self._shapes.get(key)
        if shape is None:
            raise KeyError(f"block {key}: no full checkpoint to reconstruct it from")
        out = torch.zeros((len(wanted), shape[1]), dtype=torch.float32)
        found = np.zeros(len(wanted), dtype=bool)
        for part in parts:
            at = np.clip(np.searchsorted(part.rows, wanted), 0, max(len(part.rows) - 1, 0))
            hit = np.flatnonzero(part.rows[at] == wanted) if len(part.rows) else at[:0]
            if not len(hit):
                continue
            take = pa.array(at[hit])
            subset = EncodedRows(
                {name: column.take(take) for name, column in part.encoded.columns.items()},
                part.encoded.metadata,
            )
            out[torch.from_numpy(hit)] = part.codec.decode(subset, shape[1]).float()
            found[hit] = True
        if not found.all():
            missing = wanted[~found][:5].tolist()
            raise KeyError(f"block {key}: rows {missing} have no reconstruction")
        if overlay is not None:
            slots = overlay.slot[wanted]
            changed = np.flatnonzero(slots >= 0)
            if len(changed):
                out[torch.from_numpy(changed)] = overlay.values[torch.from_numpy(slots[changed])]
        return out

    def apply(self, edit: ReferenceEdit) -> None:
        """Applies a committed diff's edit: its rows now reconstruct as it wrote them."""
        with self._lock:
            if edit.restarts_chain:
                self._overlay.clear()
            for key, local_rows, values in edit.changes:
                overlay = self._overlay.get(key)
                if overlay is None:
                    overlay = self._overlay[key] = _Overlay(*self._shapes[key])
                overlay.put(local_rows, values)


class ReferenceEdit:
    """A diff's changes to the reference, kept aside until its checkpoint commits.

    Args:
        restarts_chain: a one-shot diff that incremental diffs may follow: the overlay
            restarts from the base with what this diff reconstructs.
    """

    def __init__(self, restarts_chain: bool = False) -> None:
        self.restarts_chain = restarts_chain
        self.changes: list[tuple[str, np.ndarray, torch.Tensor]] = []
        self._lock = threading.Lock()  # units of one save are encoded by several threads

    def replace(self, key: str, local_rows: torch.Tensor, current: torch.Tensor) -> None:
        """Rows ``local_rows`` of block ``key`` will reconstruct as ``current``."""
        change = (key, local_rows.cpu().numpy(), current.float().cpu())
        with self._lock:
            self.changes.append(change)
