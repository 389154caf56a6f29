"""The manifest a commit writes, built from what every rank reported: one function, which the
persist calls on every rank and ``benchmarks/scale.py`` calls for thousands of simulated ones.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from embckpt.errors import SaveError
from embckpt.policy import Decision, Kind, assumed_chain_bytes
from embckpt.storage.manifest import (
    PARTS_VERSION,
    FileEntry,
    HistoryEntry,
    Manifest,
    PartEntry,
    TableEntry,
)


@dataclass(frozen=True)
class Reported:
    """What one rank tells the others at the commit: its part (format 5; None when its files
    are listed in the manifest itself) and its files the part does not hold."""

    part: PartEntry | None
    files: list[FileEntry]


@dataclass(frozen=True)
class CommitFacts:
    """What every rank knows of the checkpoint it commits, besides what the ranks reported."""

    step: int
    decision: Decision
    policy: str
    world_size: int
    rank: int
    codec: Mapping[str, Any]
    tables: tuple[TableEntry, ...]
    head: Manifest | None  # the chain's newest checkpoint, which this one continues
    full_fp32_bytes: int
    dirty_fraction: float
    touched_fraction: float
    started: float  # perf_counter at the save's start
    restores: int


def build_manifest(
    facts: CommitFacts,
    gathered: Sequence[tuple[Reported, dict[str, float]]],
    own_rows: Sequence[FileEntry],
) -> Manifest:
    """The checkpoint's manifest from every rank's report and phase seconds (``gathered``, by
    rank); with parts, its ``files`` hold this rank's rows files ``own_rows`` only
    (``Manifest.loaded``): what the rank wrote, and all a restore on the same plan reads.

    Raises:
        SaveError: two entries name one file (a naming bug: the checkpoint could not be
            restored, so every rank refuses it).
    """
    full = facts.decision.kind is Kind.FULL
    head = facts.head
    phases = [p for _, p in gathered]
    slowest = max(range(len(phases)), key=lambda r: sum(phases[r].values()))
    parts = tuple(r.part for r, _ in gathered if r.part is not None)
    files = [e for r, _ in gathered for e in r.files]
    loaded: frozenset[int] | None = None
    if parts:
        files += [*own_rows, *(p.rank_entry for p in parts)]
        loaded = frozenset({facts.rank})
    manifest = Manifest(
        step=facts.step,
        kind=facts.decision.kind.value,
        policy=facts.policy,
        base_step=facts.step if full or head is None else head.base_step,
        parent_step=None if full or head is None else _parent(head, facts.decision),
        world_size=facts.world_size,
        codec=facts.codec,
        tables=facts.tables,
        files=tuple(sorted(files, key=lambda f: f.path)),
        parts=parts,
        tables_from=None if full else _tables_from(head, facts.tables),
        loaded=loaded,
    )
    total = manifest.total_bytes
    entry = HistoryEntry(facts.step, facts.decision.kind.value, total, facts.dirty_fraction)
    chained = 0 if full or head is None else chain_bytes(head, facts.decision.one_shot)
    manifest = replace(
        manifest,
        history=(entry,) if full or head is None else (*head.history, entry),
        stats={
            "rows_written": manifest.rows_written,
            "dirty_fraction": facts.dirty_fraction,
            "touched_fraction": facts.touched_fraction,
            "full_fp32_bytes": facts.full_fp32_bytes,
            "save_seconds": time.perf_counter() - facts.started,
            "phase_seconds": phases[slowest],
            "phase_rank": slowest,
            "reason": facts.decision.reason,
            "chain_bytes": total + chained,
            "restores": facts.restores,
            "created_unix": time.time(),
        },
    )
    twice = manifest.repeated_paths()
    if twice:  # every rank builds the same manifest, so every rank refuses it
        raise SaveError(
            f"step {facts.step}: file {twice[0]!r} was written for two blocks: the "
            "checkpoint could not be restored, so it is not committed"
        )
    return manifest


def chain_bytes(head: Manifest, one_shot: bool = False) -> int:
    """Bytes a restore reads for a diff after ``head`` besides its own: the whole chain up to
    ``head`` (incremental), or its full alone (``one_shot``). Manifests without the figure are
    taken as one-shot chains (``policy.assumed_chain_bytes``)."""
    if one_shot:
        return head.history[0].bytes
    known = head.stats.get("chain_bytes")
    return known if isinstance(known, int) else assumed_chain_bytes(head.history)


def _parent(head: Manifest, decision: Decision) -> int:
    """One-shot diffs sit on the full checkpoint; incremental ones on the previous checkpoint."""
    return head.base_step if decision.one_shot else head.step


def _tables_from(head: Manifest | None, tables: tuple[TableEntry, ...]) -> int | None:
    """The step whose manifest lists a diff's tables, when they are those of its chain's full
    checkpoint (a format-5 one that lists them): the full, which every restore of the diff
    reads and retention keeps while the diff is kept."""
    if head is None or head.format_version < PARTS_VERSION:
        return None
    if head.tables is not tables and head.tables != tables:
        return None
    if head.step == head.base_step and head.tables_from is None:
        return head.step
    return head.base_step if head.tables_from == head.base_step else None
