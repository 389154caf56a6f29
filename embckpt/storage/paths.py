"""Which names a manifest may give its files: only names inside its own step folder.

A manifest is data that anyone who can write the directory can forge, checksum included; the
files it names are read, checked and exported. A name that left the step folder would make
``verify`` vouch for, and ``export`` copy, a file outside the checkpoint.
"""

from __future__ import annotations


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
