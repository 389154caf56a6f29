"""Which names a manifest may give its files: only names inside its own step folder.

A manifest is data that anyone who can write the directory can forge, checksum included; the
files it names are read, checked and exported. A name that left the step folder would make
``verify`` vouch for, and ``export`` copy, a file outside the checkpoint.
"""

from __future__ import annotations


def path_problem(relative: object) -> str | None:
    """Why ``relative`` cannot name a file inside a step folder, or None if it can.

    A manifest names its files relative to its own step folder: plain ``/``-separated names,
    never absolute, never with a URI scheme, a drive, a backslash, ``.`` or ``..`` parts or
    empty parts. (Symbolic links that leave the folder are checked where the files are:
    ``CheckpointStore.check_contained``.)
    """
    if not isinstance(relative, str) or not relative:
        return "the path is empty or not a string"
    if relative.startswith("/"):
        return "an absolute path leaves the checkpoint folder"
    if "\\" in relative or ":" in relative or "\x00" in relative:
        return "a path with a scheme, drive, backslash or NUL leaves or escapes the folder"
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "a path with '..', '.' or empty parts may leave the checkpoint folder"
    return None
