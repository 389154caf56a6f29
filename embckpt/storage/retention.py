"""Retention: delete what no kept checkpoint needs, never what one does.

The kept set is the last ``keep_last`` committed checkpoints plus every checkpoint on their
chains (full base and the diffs a restore applies). Deletion goes from the newest step down, and
each checkpoint loses its manifest before its files: a crash at any point leaves only committed
checkpoints whose chains are complete, and leftovers that ``verify`` reports.
"""

from __future__ import annotations

import logging

from embckpt.storage.chain import load_manifests, needed_steps
from embckpt.storage.fs import CheckpointStore

log = logging.getLogger(__name__)


def apply_retention(store: CheckpointStore, keep_last: int) -> list[int]:
    """Deletes committed checkpoints outside the last ``keep_last`` and their chains.

    Returns:
        The deleted steps. A manifest that cannot be read stops the clean-up: what a damaged
        checkpoint needs cannot be known, so nothing is deleted.
    """
    if keep_last <= 0:
        return []
    manifests, problems = load_manifests(store)
    if problems:
        log.warning("retention skipped: unreadable manifests %s", [p for p, _ in problems])
        return []
    steps = sorted(manifests)
    keep = needed_steps(manifests, steps[-keep_last:])
    doomed = sorted((s for s in steps if s not in keep), reverse=True)
    for step in doomed:
        store.remove_step(step)
    return doomed
