"""Retention: delete what no kept checkpoint needs, never what one does; and set newer
checkpoints aside when a job resumes from an older one.

The kept set is the last ``keep_last`` committed checkpoints plus every checkpoint on their
chains (full base and the diffs a restore applies). Deletion goes from the newest step down, and
each checkpoint loses its manifest before its files: a crash at any point leaves only committed
checkpoints whose chains are complete, and leftovers that ``verify`` reports.

Resuming from step N while newer checkpoints exist (``restore(N, discard_newer=True)``) moves
every committed checkpoint after N, newest first, to ``discarded/after_step_<N>_<time>/`` under
the root: kept for a human to inspect or move back, never read by restore, verify, retention or
the report (they list ``step_*`` folders of the root only). A local folder moves in one rename;
on object stores the manifest moves first, so a crash half-way leaves a leftover (cleaned by the
next job) and an incomplete copy under ``discarded/``, never a broken committed checkpoint.
"""

from __future__ import annotations

import logging
import time

import pyarrow.fs as pafs

from embckpt.storage.chain import load_manifests, needed_steps
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME, discarded_dir, step_dir_name

log = logging.getLogger(__name__)


def apply_retention(store: CheckpointStore, keep_last: int) -> list[int]:
    """Deletes committed checkpoints outside the last ``keep_last`` and their chains.

    Returns:
        The deleted steps. A manifest that cannot be read stops the clean-up: what a damaged
        checkpoint needs cannot be known, so nothing is deleted.
    """
    if keep_last <= 0:
        return []
    manifests, problems = load_manifests(store, parts=False)
    if problems:
        log.warning("retention skipped: unreadable manifests %s", [p for p, _ in problems])
        return []
    steps = sorted(manifests)
    keep = needed_steps(manifests, steps[-keep_last:])
    doomed = sorted((s for s in steps if s not in keep), reverse=True)
    for step in doomed:
        store.remove_step(step)
    return doomed


def discard_newer(store: CheckpointStore, step: int) -> tuple[list[int], str | None]:
    """Moves committed checkpoints newer than ``step`` aside (see module doc); call only while
    holding the directory's lock.

    Returns:
        The steps moved, newest first, and the folder they went to (None if none was newer).
    """
    newer = store.committed_after(step)[::-1]
    if not newer:
        return [], None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    into = f"{store.root}/{discarded_dir(step, stamp)}"
    store.fs.create_dir(into, recursive=True)
    for moved in newer:
        source, target = store.step_path(moved), f"{into}/{step_dir_name(moved)}"
        if store.is_local:
            store.fs.move(source, target)  # one rename: committed here or there, never half
            continue
        files = [
            info.path
            for info in store.fs.get_file_info(pafs.FileSelector(source, recursive=True))
            if info.type == pafs.FileType.File and info.base_name != MANIFEST_NAME
        ]
        store.fs.create_dir(target, recursive=True)
        store.fs.move(store.step_path(moved, MANIFEST_NAME), f"{target}/{MANIFEST_NAME}")
        for path in files:
            relative = path[len(source) + 1 :]
            if "/" in relative:
                store.fs.create_dir(f"{target}/{relative.rsplit('/', 1)[0]}", recursive=True)
            store.fs.move(path, f"{target}/{relative}")
        store.fs.delete_dir(source)
    return newer, into
