"""Which names a manifest may give its files: only names inside its own step folder.

A manifest is data that anyone who can write the directory can forge, checksum included; the
files it names are read, checked and exported. A name that left the step folder would make
``verify`` vouch for, and ``export`` copy, a file outside the checkpoint.
"""

from __future__ import annotations

import os


def path_problem(relative: object) -> str | None:
    """Why ``relative`` cannot name a file inside a step folder, or None if it can.

    A manifest names its files relative to its own step folder: plain ``/``-separated names,
    never absolute, never with a URI scheme or a drive (a ``:`` in the first part), a
    backslash, ``.`` or ``..`` parts or empty parts. A ``:`` in a later part stays inside (a
    table named ``user:id`` gives ``tables/user:id/...``), so it is allowed. (Symbolic links
    that leave the folder are checked where the files are: ``CheckpointStore.check_contained``.)
    """
    if not isinstance(relative, str) or not relative:
        return "the path is empty or not a string"
    if relative.startswith("/"):
        return "an absolute path leaves the checkpoint folder"
    parts = relative.split("/")
    if ":" in parts[0]:
        return "a path with a URI scheme or a drive leaves the checkpoint folder"
    if "\\" in relative or "\x00" in relative:
        return "a path with a backslash or NUL may escape the checkpoint folder"
    if any(part in ("", ".", "..") for part in parts):
        return "a path with '..', '.' or empty parts may leave the checkpoint folder"
    return None


def real_path_below(real_base: str, relative: str) -> str:
    """The real path of ``real_base/relative``, where ``real_base`` is a real path already:
    one ``lstat`` per name below it (``os.path.realpath`` takes one per name from the
    filesystem's root: on the 2-core machine of ``benchmarks/results/``, half the time of
    reading a 16-link chain's manifests), a full resolution from a symbolic link on, or for
    a name this module refuses."""
    if path_problem(relative) is not None:
        return os.path.realpath(os.path.join(real_base, relative))
    path = real_base
    for name in relative.split("/"):
        path = os.path.join(path, name)
        if os.path.islink(path):
            return os.path.realpath(os.path.join(real_base, relative))
    return path
