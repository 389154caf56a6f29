"""A save as a transaction: every change it makes outside its own files is staged, and applied on
every rank only once the manifest has committed; a failure anywhere puts everything back.

The state a save changes (held by :class:`SaveState`), and what commit and roll-back do:

- tracker bits (``since_last``; ``since_full`` too for a full): taken, i.e. cleared, at the
  snapshot, so rows touched meanwhile count for the next save. Commit: nothing (the rows are
  written). Roll back: given back (OR-ed into the views).
- writer's reference, diff of an additive codec: only read; what the diff's rows now reconstruct
  as goes to a :class:`ReferenceEdit`. Commit: applied. Roll back: dropped.
- writer's reference, full of an additive codec: rebuilt in place (keeping the old one until the
  commit would double its memory at every full). Commit: kept. Roll back: cleared, so the
  next save is a full.
- chain head (its history is the policy's input; the next diff's parent and
  ``chain_bytes``): unchanged during the save. Commit: the new manifest. Roll back: nothing.
- interval clock (the iterations timed since the last checkpoint): collected at the decision.
  Roll back: the window is given back, with the iterations timed since.
- adaptive interval (interval, cost and iteration averages): updated at the decision. Roll
  back: restored.
- ``maybe_save``'s next step and the last blocked time: set at the decision. Roll back:
  restored, so ``maybe_save`` tries again at the next step.
- writer's reconstruction (debug capture): rows captured into a :class:`CaptureEdit`.
  Commit: applied. Roll back: dropped.
- the step folder: files written. Commit: the manifest makes it a checkpoint. Roll back:
  rank 0 deletes it (a folder it cannot delete is a leftover, never read).

The persist thread never changes this state: it settles the save's outcome (committed, with the
manifest, or failed, with the error, the same on every rank since the ranks agree before and
after the manifest is written), and the training thread applies it
(:meth:`Saver.resolve`) before its next decision, restore or close, so no state is changed by
two threads at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embckpt.interval import AdaptiveInterval, ClockWindow, IntervalState, IterationClock
from embckpt.policy import Decision, Kind
from embckpt.save.capture import CaptureEdit, WriterReconstruction
from embckpt.save.reference import ReconstructedRows, ReferenceEdit
from embckpt.save.writer import WriteEdits
from embckpt.storage.manifest import Manifest
from embckpt.tracking import RowTracker, View


@dataclass
class SaveState:
    """Everything that outlives a save and that a save changes, owned by the ``Saver``. A save
    changes it only under a :class:`SaveTransaction`, which records how to undo each change;
    ``maybe_save`` ticks the clock, and a restore resets the rest. Folding pending tracker bits
    into the views (and marking rows a dense optimizer moved) is never undone: those rows did
    change."""

    tracker: RowTracker
    reference: ReconstructedRows
    interval: AdaptiveInterval
    clock: IterationClock
    head: Manifest | None = None  # the last committed checkpoint of this run's chain
    next_step: int | None = None  # the step maybe_save checkpoints next
    last_blocked_s: float = 0.0  # how long the last save held the training thread
    reconstruction: WriterReconstruction | None = None  # debug capture, when tracked


@dataclass
class SaveTransaction:
    """One save's staged changes to :class:`SaveState`, and what undoes them."""

    step: int
    state: SaveState
    decision: Decision | None = None
    edits: WriteEdits = field(default_factory=WriteEdits)
    rebuilds_reference: bool = False
    taken: dict[View, list[torch.Tensor]] = field(default_factory=dict)
    _interval: IntervalState | None = None
    _window: ClockWindow | None = None
    _next_step: int | None = None
    _last_blocked_s: float = 0.0
    _done: bool = False

    def __post_init__(self) -> None:
        s = self.state
        self._interval = s.interval.state()
        self._window = s.clock.window()
        self._next_step = s.next_step
        self._last_blocked_s = s.last_blocked_s

    def decided(self, decision: Decision, reference_codec: bool, mixes_diffs: bool) -> None:
        """Records the decision; ``reference_codec``: the codec encodes against the writer's
        reference (additive codecs)."""
        self.decision = decision
        capture = CaptureEdit() if self.state.reconstruction is not None else None
        reference = None
        if reference_codec and decision.kind is Kind.DIFF:
            one_shot = decision.one_shot
            # The chain goes on from this diff: incremental diffs always, one-shot ones only
            # when incremental diffs may follow them.
            if not one_shot or mixes_diffs:
                reference = ReferenceEdit(restarts_chain=one_shot)
        self.edits = WriteEdits(reference=reference, capture=capture)
        if reference_codec and decision.kind is Kind.FULL:
            self.rebuilds_reference = True
            self.state.reference.begin_full()

    def take_bits(self) -> None:
        """Takes the tracker views this checkpoint consumes (given back on failure)."""
        assert self.decision is not None
        tracker = self.state.tracker
        self.taken = {View.SINCE_LAST: tracker.take(View.SINCE_LAST)}
        if self.decision.kind is Kind.FULL:
            self.taken[View.SINCE_FULL] = tracker.take(View.SINCE_FULL)

    def commit(self, manifest: Manifest) -> None:
        """The manifest is committed on every rank: the staged changes take effect."""
        if self._done:
            return
        self._done = True
        s = self.state
        s.head = manifest
        if self.edits.reference is not None:
            s.reference.apply(self.edits.reference)
        if s.reconstruction is not None and self.edits.capture is not None:
            assert self.decision is not None
            s.reconstruction.apply(self.edits.capture, self.decision.kind is Kind.FULL)

    def roll_back(self) -> None:
        """The save failed (on some rank, in any phase): everything is as before it, but for
        a rebuilt reference, which is cleared so that the next save is a full."""
        if self._done:
            return
        self._done = True
        s = self.state
        for view, bits in self.taken.items():
            s.tracker.give_back(view, bits)
        if self.rebuilds_reference:
            s.reference.clear()
        assert self._interval is not None and self._window is not None
        s.interval.restore(self._interval)
        s.clock.give_back(self._window)
        s.next_step = self._next_step
        s.last_blocked_s = self._last_blocked_s
