"""Serving from checkpoints: a follower that applies each new committed checkpoint of a
directory onto one in-memory copy of its tables (``follower.py``), read through pinned views
(``view.py``)."""

from embckpt.serve.follower import Follower, Update
from embckpt.serve.view import View

__all__ = ["Follower", "Update", "View"]
