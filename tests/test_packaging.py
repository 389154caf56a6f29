"""Packaging: the wheel declares what the package imports, and a missing extra names itself."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from embckpt.errors import MissingExtraError, import_extra

ROOT = Path(__file__).resolve().parents[1]
# Left to the user's environment: their CPU and CUDA builds differ (README.md, Install);
# triton comes with torch's CUDA builds (codecs/device_encode.py runs without it).
USER_PROVIDED = {"torch", "torchrec", "fbgemm_gpu", "triton"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(package: Path) -> tuple[set[str], dict[str, str]]:
    """Top-level modules imported anywhere under ``package`` (statements at any depth), and
    modules loaded through ``import_extra(module, extra)`` with their extra."""
    modules: set[str] = set()
    extras: dict[str, str] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_extra"
                and all(isinstance(a, ast.Constant) for a in node.args)
            ):
                module, extra = (a.value for a in node.args)
                extras[module.split(".")[0]] = extra
    modules |= set(extras)
    return modules - set(sys.stdlib_module_names) - {"embckpt"}, extras


def _requires(wheel: Path) -> dict[str, set[str | None]]:
    """Requires-Dist of a wheel: distribution -> the extras naming it (None: always)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    found: dict[str, set[str | None]] = {}
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            spec = line.split(":", 1)[1]
            dist = re.match(r"\s*([A-Za-z0-9_.-]+)", spec).group(1)  # type: ignore[union-attr]
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", spec)
            found.setdefault(_canonical(dist), set()).add(extra.group(1) if extra else None)
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built offline from a copy of the sources (no build/ left in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "embckpt", src / "embckpt", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--disable-pip-version-check", "--no-index", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("embckpt-*.whl"))


def test_wheel_declares_every_third_party_import(wheel: Path) -> None:
    modules, extras = _imports(ROOT / "embckpt")
    requires = _requires(wheel)
    owners = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in sorted(modules - USER_PROVIDED):
        dists = {_canonical(d) for d in owners.get(module, [module])}
        declared = dists & set(requires)
        if not declared:
            undeclared[module] = sorted(dists)
            continue
        wanted = extras.get(module)
        if wanted is not None:
            # An optional module is declared under the extra its error message names.
            assert any(wanted in requires[d] for d in declared), (module, wanted, requires)
    assert not undeclared, f"imported but not in the wheel's Requires-Dist: {undeclared}"
    assert extras, "no optional module found: the scan of import_extra calls is broken"


def test_user_provided_frameworks_are_not_declared(wheel: Path) -> None:
    requires = _requires(wheel)
    assert not {"torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"} & set(requires)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "embckpt/py.typed" in names and "embckpt/cli.py" in names
    assert "embckpt/examples/demo.yaml" in names  # what `embckpt demo` runs by default
    assert not [n for n in names if n.startswith("tests/")]


def test_a_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'embckpt\[plots\]'"):
        import_extra("matplotlib", "plots")
    from embckpt.report.plots import render_png

    report = {"checkpoints": [], "tables": [], "directory": "d", "notes": []}
    with pytest.raises(MissingExtraError, match=r"embckpt\[plots\]"):
        render_png(report)


def test_the_kmeans_codec_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from embckpt.codecs import make_codec

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.cluster", None)
    codec = make_codec("kmeans", {"bits": 4})
    rows = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(MissingExtraError, match=r"pip install 'embckpt\[kmeans\]'"):
        codec.encode(rows)
