"""Shared fixtures: multi-rank tests run through embckpt's own launcher (gloo on loopback)."""

from __future__ import annotations

import os

os.environ.setdefault("LOCAL_WORLD_SIZE", "2")
