"""The package's layering holds: no import cycles, every rule of docs/ARCHITECTURE.md, and
the report needs no torch. The checks are scripts/import_graph.py's, which prints the graph."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts/import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_and_no_rule_violations() -> None:
    graph = _graph_module()
    modules, imports = graph.read_imports(REPO / "embckpt")
    assert {"checkpointer", "storage.chain", "read.restore", "save.writer"} <= modules
    assert graph.cycles(imports) == []
    assert graph.cycles(imports, "package") == []
    assert graph.violations(imports) == []


def test_rules_catch_what_they_forbid(tmp_path: Path) -> None:
    """The checker is not vacuous: a package that breaks each rule is reported."""
    graph = _graph_module()
    files = {
        "__init__.py": (
            "_EXPORTS = {'Checkpointer': 'embckpt.checkpointer',\n"
            "            'DemoConfig': 'embckpt.examples.demo'}\n"
        ),
        "errors.py": "",
        "checkpointer.py": "from embckpt.read import restore\nimport embckpt.cli_restore\n",
        "policy.py": (
            "from embckpt.storage.manifest import HistoryEntry\n"
            "def f():\n    from embckpt.tracking import View\n"
        ),
        "tracking.py": "",
        "cli.py": "",
        "codecs/__init__.py": "from embckpt.config import CheckpointConfig\n",
        "codecs/testing.py": "from embckpt.storage.manifest import Manifest\n",
        "config.py": "",
        "storage/__init__.py": "",
        "storage/manifest.py": "from embckpt.codecs import make_codec\n",
        "read/__init__.py": "",
        "read/plan.py": "from embckpt.read.stage import stage\n",
        "read/stage.py": "from embckpt.save.writer import RowFileWriter\n",
        "save/saver.py": "from embckpt.read.restore import RestoreResult\n",
        "storage/rowfile_read.py": "from embckpt.storage.rowfile_write import encode_file\n",
        "read/restore.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from embckpt.checkpointer import Checkpointer\n"
        ),
        "report/__init__.py": "import embckpt.sharding\n",
        "sharding.py": "from embckpt import cli\n",
        "examples/__init__.py": "",
        "examples/demo.py": "from embckpt.storage.manifest import Manifest\n",
    }
    for name, text in files.items():
        path = tmp_path / "embckpt" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _, imports = graph.read_imports(tmp_path / "embckpt")
    broken = "\n".join(graph.violations(imports))
    for rule in (
        "codecs import only",
        "storage imports only",
        "neither storage nor codecs",
        "save/ and read/ never import checkpointer",
        "report/ imports only",
        "examples/ use only the public API",
        "nothing imports cli",
        "policy does not import tracking",
        "read/: plan never imports stage",
        "read/ never imports save/",
        "save/ never imports read/",
        "share only storage/rowfile.py",
        "only cli imports cli_restore",
    ):
        assert rule in broken, rule
    # The package's facade is bound too: exporting from examples/ is an arrow back up.
    assert ":2 -> examples.demo: outside examples/, only cli imports examples/" in broken
    assert ["checkpointer", "read.restore"] in graph.cycles(imports)
    assert ["codecs", "storage"] in graph.cycles(imports, "package")


def test_report_and_public_api_import_without_torch() -> None:
    code = (
        "import sys, embckpt, embckpt.report; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_public_names_resolve() -> None:
    import embckpt

    for name in embckpt.__all__:
        assert getattr(embckpt, name) is not None, name


def test_example_settings_moved_out_of_the_package_namespace() -> None:
    """``embckpt.DemoConfig`` and ``embckpt.WorkloadConfig`` still work, with a warning naming
    the import to use; they are no public names of the package any more."""
    import embckpt
    from embckpt.examples import workload

    for name in ("DemoConfig", "WorkloadConfig"):
        assert name not in embckpt.__all__ and name not in dir(embckpt)
        new_import = f"from embckpt.examples.workload import {name}"
        with pytest.warns(DeprecationWarning, match=new_import):
            assert getattr(embckpt, name) is getattr(workload, name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        embckpt.NoSuchName  # noqa: B018
