"""The set-up step that compiles the codecs' kernels (``python -m embckpt.codecs.precompile``)
compiles every kernel the codecs call from Python, so that no demo rank or test process finds
one missing from numba's disk cache and compiles it on its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "embckpt"
KERNEL_MODULES = (
    "adaptive_kernels",
    "uniform_kernels",
    "kmeans_kernels",
    "huffman_kernels",
    "row_kernels",
    "delta_kernels",
)


def _called_kernels() -> set[tuple[str, str]]:
    """(module, function) of every ``<kernel module>.<name>(`` call outside the kernel
    modules (the codecs, and the restore that adds rows with them): the entry points from
    Python."""
    pattern = re.compile(rf"\b({'|'.join(KERNEL_MODULES)})\.([A-Za-z_]\w*)\(")
    calls = set()
    for path in [*(PACKAGE / "codecs").glob("*.py"), *(PACKAGE / "read").glob("*.py")]:
        if path.stem not in KERNEL_MODULES:
            calls.update(pattern.findall(path.read_text()))
    return calls


@pytest.mark.timeout(600)  # a cold numba cache compiles for minutes; warm, seconds
def test_precompile_compiles_every_kernel_the_codecs_call() -> None:
    calls = sorted(_called_kernels())
    assert ("adaptive_kernels", "search_rows") in calls and len(calls) >= 8, calls
    # The command set-up runs, in a fresh interpreter (in this one, earlier tests may have
    # compiled the kernels already); then every kernel called from Python has a signature.
    code = (
        "import importlib, runpy, sys\n"
        "sys.argv = ['precompile', '--workers', '1']\n"
        "runpy.run_module('embckpt.codecs.precompile', run_name='__main__')\n"
        f"for module, name in {calls!r}:\n"
        "    kernel = getattr(importlib.import_module('embckpt.codecs.' + module), name)\n"
        "    if hasattr(kernel, 'signatures') and not kernel.signatures:\n"
        "        print('not compiled:', module, name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(
        r"embckpt: codec kernels compiled in \d+s \(adaptive search [\d.]+s, uniform quantize, "
        r"pack, decode [\d.]+s, k-means and Huffman [\d.]+s\)\n",
        done.stdout,
    ), done.stdout
