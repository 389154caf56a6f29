"""The release sets embckpt runs with, checked when it is imported.

embckpt reaches into FBGEMM's and TorchRec's kernels (their optimizer state, step counters and
row caches), whose layout changes between releases, and FBGEMM's compiled operators load only
into the torch release they were built for. So a set is one torch release with the FBGEMM built
for it and the TorchRec of the same release:

| torch | fbgemm-gpu (or fbgemm-gpu-cpu) | torchrec |
|---|---|---|
| 2.11 | 1.6 | 1.6 |
| 2.12 | 1.7 | 1.7 |
| 2.13 | 1.8 | 1.8 |
| 2.14 | 1.9 | 1.9 |

Anything else fails ``import embckpt`` with a message naming what is installed and what would
do; ``EMBCKPT_ALLOW_UNSUPPORTED=1`` turns that into a warning (a nightly build, a new release
being tried). Versions are read from the installed packages' metadata, so the check imports
none of them; a package that is not installed is left to fail where it is first used.
"""

from __future__ import annotations

import os
import re
import warnings
from importlib import metadata

# torch 2.<key> -> the fbgemm-gpu and torchrec 1.<value> released with it
SETS = {11: 6, 12: 7, 13: 8, 14: 9}
FBGEMM = ("fbgemm-gpu", "fbgemm-gpu-cpu")
ALLOW_ENV = "EMBCKPT_ALLOW_UNSUPPORTED"


class UnsupportedReleaseError(ImportError):
    """The installed torch, fbgemm-gpu and torchrec are not a set embckpt supports."""


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _minor(version: str | None, major: int) -> int | None:
    """``y`` of a release ``major.y[.z][+local]``; None for another major or a nightly."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match is None or int(match.group(1)) != major:
        return None
    return int(match.group(2))


def problems(versions: dict[str, str | None]) -> list[str]:
    """What is wrong with installed ``versions`` (distribution -> version, None: absent)."""
    torch_version = versions.get("torch")
    fbgemm_name = next((n for n in FBGEMM if versions.get(n)), None)
    fbgemm_version = versions.get(fbgemm_name) if fbgemm_name else None
    torchrec_version = versions.get("torchrec")
    found: list[str] = []
    torch_minor = _minor(torch_version, 2)
    expected = SETS.get(torch_minor) if torch_minor is not None else None
    if torch_version is not None and expected is None:
        found.append(f"torch {torch_version} (supported: 2.11 to 2.14)")
    for name, version in ((fbgemm_name, fbgemm_version), ("torchrec", torchrec_version)):
        if name is None or version is None:
            continue
        minor = _minor(version, 1)
        if minor not in SETS.values():
            found.append(f"{name} {version} (supported: 1.6 to 1.9)")
        elif expected is not None and minor != expected:
            found.append(
                f"{name} {version} with torch {torch_version} (torch 2.{torch_minor} goes with "
                f"{name} 1.{expected})"
            )
    return found


def check() -> None:
    """Fails when the installed set is not supported (see the module's docstring).

    Raises:
        UnsupportedReleaseError: naming each package out of the set, unless
            ``EMBCKPT_ALLOW_UNSUPPORTED=1`` (then a warning).
    """
    names = ("torch", *FBGEMM, "torchrec")
    found = problems({name: installed(name) for name in names})
    if not found:
        return
    message = (
        "embckpt supports torch 2.11-2.14 with the fbgemm-gpu and torchrec released with it "
        "(2.11: 1.6, 2.12: 1.7, 2.13: 1.8, 2.14: 1.9); installed: "
        + "; ".join(found)
        + f". Install a supported set, or set {ALLOW_ENV}=1 to try this one anyway."
    )
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    raise UnsupportedReleaseError(message)
