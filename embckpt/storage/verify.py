"""Offline checks of a checkpoint directory: every problem, not only the first.

A committed checkpoint is sound when its manifest parses and matches its own checksum, every
file it lists has the recorded size and checksum (CRC32C; SHA-256 in older manifests), and
every checkpoint on its chain back to the full base is itself committed. Step folders without
a manifest are leftovers of interrupted saves: reported, never counted as failures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.chain import chain_steps, load_manifests, missing_parent
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME


@dataclass
class VerifyReport:
    """Problems found, as (path, reason); checked steps and leftovers."""

    checked: list[int] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    leftovers: list[int] = field(default_factory=list)
    files_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(store: CheckpointStore, step: int | None = None) -> VerifyReport:
    """Checks every committed checkpoint (or only ``step`` and its chain)."""
    report = VerifyReport(leftovers=store.leftover_steps())
    manifests, problems = load_manifests(store)
    committed = set(store.committed_steps())
    if step is not None:
        if step not in committed:
            report.problems.append((store.step_path(step, MANIFEST_NAME), "not committed"))
            return report
        wanted = sorted(set(chain_steps(manifests, step)) | {step})
        # The walk stops at an unreadable parent: its problem belongs to this chain too.
        missing = missing_parent(manifests, step)
        involved = {*wanted, *([missing] if missing is not None else [])}
        problems = [p for p in problems if any(_in_step(store, s, p[0]) for s in involved)]
    else:
        wanted = sorted(committed)
    report.problems.extend(problems)
    for current in wanted:
        manifest = manifests.get(current)
        if manifest is None:
            continue
        report.checked.append(current)
        # Blocks of one packed file share its entry's size and checksum (the manifest
        # refuses entries of one path that disagree): each file is read and checked once.
        files = {entry.path: entry.written for entry in manifest.files}
        for written in files.values():
            report.files_checked += 1
            try:
                store.read_checked(current, written)
            except CheckpointCorruptError as exc:
                report.problems.append((exc.path, exc.reason))
        missing = missing_parent(manifests, current)
        if missing is not None and missing not in committed:
            report.problems.append(
                (
                    store.step_path(missing, MANIFEST_NAME),
                    f"missing: step {current} depends on it (base {manifest.base_step})",
                )
            )
    return report


def _in_step(store: CheckpointStore, step: int, path: str) -> bool:
    return path == store.step_path(step) or path.startswith(store.step_path(step) + "/")
