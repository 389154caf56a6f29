"""The release sets embckpt supports: torch 2.11-2.14, each with the fbgemm-gpu and torchrec
released with it. Anything else fails ``import embckpt``, naming what is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from embckpt import versions


@pytest.mark.parametrize(
    "installed",
    [
        {"torch": "2.13.0+cpu", "fbgemm-gpu-cpu": "1.8.0", "torchrec": "1.8.0"},  # CI's pins
        {"torch": "2.11.0+cu130", "fbgemm-gpu": "1.6.0", "torchrec": "1.6.1"},  # the GPU's
        {"torch": "2.12.1", "fbgemm-gpu": "1.7.0", "torchrec": "1.7.0"},
        {"torch": "2.14.0", "fbgemm-gpu-cpu": "1.9.0", "torchrec": "1.9.2"},
        {"torch": "2.13.0"},  # the others not installed: left to fail where first used
    ],
)
def test_supported_sets_pass(installed: dict[str, str]) -> None:
    assert versions.problems(installed) == []


@pytest.mark.parametrize(
    ("installed", "named"),
    [
        ({"torch": "2.10.0", "fbgemm-gpu": "1.5.0"}, ["torch 2.10.0", "fbgemm-gpu 1.5.0"]),
        ({"torch": "2.15.0.dev20261101"}, ["torch 2.15.0.dev20261101"]),
        (
            {"torch": "2.13.0", "fbgemm-gpu": "1.6.0", "torchrec": "1.8.0"},
            ["fbgemm-gpu 1.6.0 with torch 2.13.0 (torch 2.13 goes with fbgemm-gpu 1.8)"],
        ),
        ({"torch": "2.11.0", "fbgemm-gpu": "1.6.0", "torchrec": "1.9.0"}, ["torchrec 1.9.0"]),
        ({"torchrec": "2.0.0"}, ["torchrec 2.0.0 (supported: 1.6 to 1.9)"]),
    ],
)
def test_other_sets_are_named(installed: dict[str, str], named: list[str]) -> None:
    found = versions.problems(installed)
    assert len(found) == len(named), found
    for problem, name in zip(found, named, strict=True):
        assert problem.startswith(name), found


def _fake_distribution(root: Path, name: str, version: str) -> None:
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _import_embckpt(site: Path, **env: str) -> subprocess.CompletedProcess[str]:
    inherited = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(site), str(Path(__file__).parents[1]), inherited) if p)
    return subprocess.run(
        [sys.executable, "-c", "import embckpt"],
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_unsupported_set_fails_at_import(tmp_path: Path) -> None:
    """A torchrec older than the set (found first on the path) stops ``import embckpt`` with
    the set it needs; ``EMBCKPT_ALLOW_UNSUPPORTED=1`` lets it through with a warning."""
    _fake_distribution(tmp_path, "torchrec", "1.5.0")
    refused = _import_embckpt(tmp_path)
    assert refused.returncode != 0
    assert "UnsupportedReleaseError" in refused.stderr
    assert "torchrec 1.5.0" in refused.stderr
    assert "EMBCKPT_ALLOW_UNSUPPORTED=1" in refused.stderr
    allowed = _import_embckpt(tmp_path, EMBCKPT_ALLOW_UNSUPPORTED="1")
    assert allowed.returncode == 0, allowed.stderr
    assert "torchrec 1.5.0" in allowed.stderr  # the warning
