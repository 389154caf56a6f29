"""The names of everything in a checkpoint directory, in one place.

docs/ARCHITECTURE.md ("Directory") draws the tree these names make. Writers build names here,
and readers recognise them here, so the two cannot drift apart. Which names a manifest may
give its files (never outside its step folder) is ``storage/paths.py``'s concern.
"""

from __future__ import annotations

import re
import uuid

MANIFEST_NAME = "MANIFEST.json"
LOCK_NAME = "LOCK"
DISCARDED_DIR = "discarded"
DENSE_FILE = "dense/model.safetensors"
TEMP_MARK = ".tmp-"  # a write in progress: ``<final name>.tmp-<random>``, renamed when whole

_STEP_DIR = re.compile(r"^step_(\d{12})$")


def step_dir_name(step: int) -> str:
    """The folder of checkpoint ``step``: ``step_`` and 12 digits, so names sort as steps."""
    return f"step_{step:012d}"


def step_of_dir(name: str) -> int | None:
    """The step a folder name stands for, or None if it is not a step folder."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def rank_file(rank: int) -> str:
    """A rank's own state (RNG streams, statefuls), relative to the step folder."""
    return f"dense/rank_{rank:05d}.safetensors"


def rows_file(table: str, row_offset: int, col_offset: int, part: int, whole: bool) -> str:
    """A saved rows file of one block, relative to the step folder.

    A block is named by its first global row and column; a large block is written in several
    parts; a ``delta`` diff's rows written whole go to a sibling ``.whole`` file (in a packed
    file, to a block of their own beside the delta rows').
    """
    suffix = ".whole" if whole else ""
    return f"tables/{table}/r{row_offset}_c{col_offset}.p{part}{suffix}.parquet"


def packed_rows_file(rank: int, number: int) -> str:
    """A rows file of one rank packing several small blocks (format 4), relative to the step
    folder: the rank's ``number``-th of the checkpoint."""
    return f"packed/rank_{rank:05d}.{number}.parquet"


def merged_rows_file(
    prefix: str, table: str, row_offset: int, col_offset: int, source_step: int, source: int
) -> str:
    """A rows file written by a merge: unique per source file (its step and its number in the
    block), under ``prefix`` (a folder no file of the target checkpoint uses)."""
    name = f"r{row_offset}_c{col_offset}.s{source_step}.f{source}.parquet"
    return f"{prefix}tables/{table}/{name}"


def merged_prefix(taken: int) -> str:
    """The folder of a merge's files: ``merged/``, else ``merged<n>/`` when earlier merges
    into the same checkpoint took the lower numbers (``taken`` of them)."""
    return "merged/" if taken == 0 else f"merged{taken}/"


def discarded_dir(step: int, stamp: str) -> str:
    """The folder, relative to the root, that a resume from ``step`` moves newer checkpoints
    into: ``discarded/after_step_<N>_<time>_<random>``."""
    return f"{DISCARDED_DIR}/after_{step_dir_name(step)}_{stamp}_{uuid.uuid4().hex[:6]}"


def temp_name(path: str) -> str:
    """A fresh temporary name next to ``path``, for a write renamed into place when whole."""
    return f"{path}{TEMP_MARK}{uuid.uuid4().hex[:8]}"


def is_temp(name: str) -> bool:
    """Whether a file name is a temporary one left by an interrupted write."""
    return TEMP_MARK in name


REPLICAS_DIR = "replicas"  # under a node's local folder: ``replicas/<node>/step_*`` of a peer
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def node_folder(node: str) -> str:
    """A node's folder under ``local_dir`` (``tiers/``): its id, refused if it could name
    anything else (a path, ``..``).

    Raises:
        ValueError: the id is not letters, digits, ``.``, ``_`` and ``-``.
    """
    if not _NODE.match(node):
        raise ValueError(f"node id {node!r}: use letters, digits, '.', '_' and '-' only")
    return node


def replica_folder(node: str) -> str:
    """Where a node keeps the replica of peer ``node``'s files, relative to its own folder."""
    return f"{REPLICAS_DIR}/{node_folder(node)}"
