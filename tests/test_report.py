"""Storage-cost reports: totals are the bytes on disk, the JSON schema is the documented one, odd
directories are described rather than fatal, and figures, page and projection come out right."""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import toy_model as tm

import embckpt.report.build
import embckpt.report.projection
from embckpt.cli import main
from embckpt.report.build import build_report
from embckpt.report.projection import parse_duration, parse_size, project
from embckpt.storage.fs import CheckpointStore

pytestmark = pytest.mark.slow(20)  # seconds here, on 2 cores: see conftest.py

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _report_json(directory: Path, capsys: pytest.CaptureFixture, *extra: str) -> dict[str, Any]:
    assert main(["report", str(directory), "--json", *extra]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out)


def _data_files(step_dir: Path) -> list[Path]:
    return [p for p in step_dir.rglob("*") if p.is_file() and p.name != "MANIFEST.json"]


# -- totals are what is on disk ------------------------------------------------------------------
@pytest.mark.parametrize("run, chain", [("one_shot", [5, 15]), ("incremental", [5, 10, 15])])
def test_totals_equal_the_bytes_on_disk(
    saved_runs: Path, capsys: pytest.CaptureFixture, run: str, chain: list[int]
) -> None:
    directory = saved_runs / run
    report = _report_json(directory, capsys)
    on_disk = {}
    for checkpoint in report["checkpoints"]:
        files = _data_files(directory / f"step_{checkpoint['step']:012d}")
        on_disk[checkpoint["step"]] = sum(p.stat().st_size for p in files)
        assert checkpoint["bytes"] == checkpoint["bytes_on_disk"] == on_disk[checkpoint["step"]]
        assert checkpoint["files"] == len(files)
        rows_files = [p for p in files if "tables" in p.parts or "packed" in p.parts]
        assert sum(t["bytes"] for t in checkpoint["tables"]) == sum(
            p.stat().st_size for p in rows_files
        )
    assert sorted(on_disk) == [5, 10, 15]
    totals = report["totals"]
    assert totals["bytes_written"] == totals["storage_held_bytes"] == sum(on_disk.values())
    assert [c["cumulative_bytes"] for c in report["checkpoints"]] == [
        on_disk[5],
        on_disk[5] + on_disk[10],
        sum(on_disk.values()),
    ]
    assert totals["restore_chain_steps"] == chain and totals["restore_chain_complete"]
    assert totals["restore_chain_bytes"] == sum(on_disk[s] for s in chain)
    assert report["checkpoints"][-1]["restore_chain_bytes"] == totals["restore_chain_bytes"]
    assert totals["full_every_time_bytes"] == 3 * on_disk[5]
    assert (totals["checkpoints"], totals["full_checkpoints"], totals["diff_checkpoints"]) == (
        3,
        1,
        2,
    )
    table_bytes = sum(t["bytes_written"] for t in report["tables"])
    assert table_bytes == sum(t["bytes"] for c in report["checkpoints"] for t in c["tables"])
    assert report["notes"] == [] and report["leftovers"] == []


def test_per_table_rows_count_each_row_once(
    saved_runs: Path, capsys: pytest.CaptureFixture
) -> None:
    report = _report_json(saved_runs / "one_shot", capsys)
    full = report["checkpoints"][0]
    # A full checkpoint writes every row of every table once, whatever the sharding.
    by_name = {t["name"]: t for t in report["tables"]}
    for written in full["tables"]:
        assert written["rows"] == by_name[written["name"]]["rows"]
        assert written["touched_fraction"] == 1.0
    for table in report["tables"]:
        assert table["checkpoints"] == 3
        assert table["full_fp32_bytes_written"] == 3 * table["full_fp32_bytes"]
        assert table["ratio_vs_full_fp32"] == pytest.approx(
            table["full_fp32_bytes_written"] / table["bytes_written"]
        )
        assert 0 < table["mean_diff_touched_fraction"] < 1  # 80 hot rows of 240 move


# -- the JSON schema is the documented one --------------------------------------------------------
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "object": (dict,),
    "list[int]": (list,),
    "list[str]": (list,),
}
_KINDS = "|".join(re.escape(kind) for kind in _TYPES)


def _documented(doc: str) -> dict[str, Any]:
    """The schema block of a module docstring: {key: type} with nested {key[]: {...}}."""
    block = doc.split("::\n", 1)[1]
    schema: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, schema)]
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        match = re.match(rf"(\w+)(\[\])?:\s*((?:{_KINDS})\??)?(?!\w)", line.strip())
        assert match, line
        while stack[-1][0] >= indent:
            stack.pop()
        name, is_list, kind = match.groups()
        parent = stack[-1][1]
        if kind is None:  # a nested object or a list of objects follows
            parent[name + (is_list or "")] = child = {}
            stack.append((indent, child))
        else:
            parent[name] = kind
    return schema


def _check(value: dict[str, Any], schema: dict[str, Any], where: str) -> None:
    keys = {k.removesuffix("[]") for k in schema}
    assert set(value) == keys, (
        f"{where}: undocumented {set(value) - keys}, missing {keys - set(value)}"
    )
    for key, kind in schema.items():
        name = key.removesuffix("[]")
        got = value[name]
        if isinstance(kind, dict):
            items = got if key.endswith("[]") else [got]
            assert isinstance(items, list), f"{where}.{name}"
            for item in items:
                _check(item, kind, f"{where}.{name}")
            continue
        if kind.endswith("?") and got is None:
            continue
        wanted = _TYPES[kind.rstrip("?")]
        assert isinstance(got, wanted) and not (isinstance(got, bool) and bool not in wanted), (
            f"{where}.{name}: {got!r} is not {kind}"
        )
        if kind.startswith("list[int]"):
            assert all(isinstance(v, int) for v in got)
        if kind.startswith("list[str]"):
            assert all(isinstance(v, str) for v in got)


def test_json_follows_the_documented_schema(
    saved_runs: Path, capsys: pytest.CaptureFixture
) -> None:
    schema = _documented(embckpt.report.build.__doc__ or "")
    assert {"checkpoints[]", "tables[]", "totals", "projection"} <= set(schema)
    projection_schema = _documented(embckpt.report.projection.__doc__ or "")
    schema["projection"] = projection_schema
    report = _report_json(saved_runs / "incremental", capsys, "--project", "--model-bytes", "2TB")
    _check(report, schema, "report")
    plain = _report_json(saved_runs / "incremental", capsys)  # no projection key without it
    _check(plain, {k: v for k, v in schema.items() if k != "projection"}, "report")
    assert report["checkpoints"] and report["tables"] and report["checkpoints"][0]["tables"]
    # The spine's fields keep their names and meaning.
    first = report["checkpoints"][0]
    assert first["kind"] == "full" and first["parent_step"] is None and first["base_step"] == 5
    assert first["reason"] and first["codec"] == "raw"
    assert report["checkpoints"][2]["parent_step"] == 10  # incremental: on the previous one


def test_schema_check_catches_a_wrong_type() -> None:
    with pytest.raises(AssertionError, match="is not int"):
        _check({"a": "x"}, {"a": "int"}, "r")
    with pytest.raises(AssertionError, match="undocumented"):
        _check({"a": 1, "b": 2}, {"a": "int"}, "r")


# -- odd directories are described, never fatal -------------------------------------------------
def test_a_missing_directory_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "never_written"
    assert main(["report", str(missing)]) == 0
    out = capsys.readouterr().out
    assert "does not exist" in out and "0 checkpoints" in out
    report = _report_json(missing, capsys)
    assert report["checkpoints"] == [] and report["totals"]["storage_held_bytes"] == 0
    assert report["totals"]["restore_chain_steps"] == []
    assert not report["totals"]["restore_chain_complete"]


def test_an_empty_directory_says_so_and_still_draws(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    png, page = tmp_path / "r.png", tmp_path / "r.html"
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["report", str(empty), "--plot", str(png), "--html", str(page), "--project"]
    assert main([*argv, "--model-bytes", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "holds no committed checkpoint" in out and "projection: nothing measured" in out
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "holds no committed checkpoint" in page.read_text()


def test_a_half_written_directory_counts_only_committed_checkpoints(
    run_copy: Path, saved_runs: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = run_copy / "one_shot"
    debris = directory / "step_000000000020" / "tables" / tm.table("rw")
    debris.mkdir(parents=True)
    (debris / "half.parquet").write_bytes(b"PAR1" * 100)
    report = _report_json(directory, capsys)
    clean = build_report(CheckpointStore(saved_runs / "one_shot"))
    assert report["leftovers"] == [20] and report["totals"]["leftover_bytes"] == 400
    assert report["totals"]["bytes_written"] == clean["totals"]["bytes_written"]
    assert any("without a manifest [20]" in note for note in report["notes"])
    assert main(["report", str(directory)]) == 0
    assert "interrupted saves" in capsys.readouterr().out


def test_only_a_half_written_step_says_no_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "step_000000000005").mkdir()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "holds no committed checkpoint" in out and "without a manifest [5]" in out


def test_a_broken_manifest_and_chain_are_reported(
    run_copy: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = run_copy / "incremental"
    manifest = directory / "step_000000000010" / "MANIFEST.json"
    manifest.write_text(manifest.read_text().replace('"kind": "diff"', '"kind": "full"'))
    report = _report_json(directory, capsys)
    assert [c["step"] for c in report["checkpoints"]] == [5, 15]
    assert report["unreadable"][0]["path"].endswith("step_000000000010/MANIFEST.json")
    assert not report["totals"]["restore_chain_complete"]
    assert any("chain is broken" in note for note in report["notes"])


# -- the text form, figures and page --------------------------------------------------------------
def test_text_lists_checkpoints_tables_and_totals(
    saved_runs: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["report", str(saved_runs / "one_shot")]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoints (1 full, 2 diff)" in out
    assert re.search(r"^\s+15 diff\s+5 .* rows changed since the last full$", out, re.M)
    for table in (tm.table("rw"), tm.table("cw"), tm.table("dp")):
        assert re.search(rf"^{table} .* 240 x 8", out, re.M)
    assert "written " in out and "held now " in out and "steps 5 -> 15" in out
    assert capsys.readouterr().err == ""  # no progress line for 3 checkpoints off a terminal


def test_progress_line_goes_to_stderr(saved_runs: Path, capsys: pytest.CaptureFixture) -> None:
    build_report(CheckpointStore(saved_runs / "one_shot"), progress=True)
    captured = capsys.readouterr()
    assert "reading manifests" in captured.err and captured.out == ""


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(PNG_MAGIC) and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_and_html_are_written(
    saved_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    png, page = tmp_path / "r.png", tmp_path / "r.html"
    argv = ["report", str(saved_runs / "one_shot"), "--plot", str(png), "--html", str(page)]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # file messages go to stderr, stdout stays JSON
    assert f"wrote {png}" in captured.err
    data = png.read_bytes()
    width, height = _png_size(data)
    assert 20_000 < len(data) < 2_000_000 and width >= 800 and height >= 1000
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count("<table") >= 3
    for step in (5, 10, 15):
        assert f"<td>{step}</td>" in text
    embedded = re.search(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert embedded and base64.b64decode(embedded.group(1)) == data
    # Self-contained: nothing fetched from elsewhere.
    assert not re.search(r"(src|href)=['\"](?!data:)", text) and "<script" not in text


def test_fp32_baseline_counts_every_file_the_bars_count(saved_runs: Path) -> None:
    """The baseline is a full fp32 checkpoint of the same files: every table's values and
    optimizer state in fp32 (measured here from the lossless full checkpoint's row columns) plus
    the dense and per-rank files each checkpoint writes whole (measured on disk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from embckpt.report.plots import _figure

    directory = saved_runs / "one_shot"
    full = directory / "step_000000000005"
    # The raw codec stores every value and optimizer state in fixed-width fp32 columns.
    columns = [
        column
        for path in full.rglob("*.parquet")  # tables/ and packed/
        for column in pq.read_table(path).drop_columns(["row", "table", "col"]).columns
    ]
    assert all(column.null_count == 0 for column in columns)
    tables_fp32 = sum(
        len(column) * column.type.list_size * column.type.value_type.byte_width
        if pa.types.is_fixed_size_list(column.type)
        else len(column) * column.type.byte_width
        for column in columns
    )
    assert tables_fp32 == 5 * 240 * 8 * 4 + 4 * 240 * 4 + 240 * 4  # values, momentum (cw: 2)
    side = {
        step: sum(p.stat().st_size for p in (directory / f"step_{step:012d}/dense").iterdir())
        for step in (5, 10, 15)
    }
    on_disk = {
        step: sum(p.stat().st_size for p in _data_files(directory / f"step_{step:012d}"))
        for step in (5, 10, 15)
    }
    report = build_report(CheckpointStore(directory))
    rows = report["checkpoints"]
    assert [r["side_bytes"] for r in rows] == [side[5], side[10], side[15]]
    assert all(s > 0 for s in side.values())
    expected = [tables_fp32 + side[s] for s in (5, 10, 15)]
    assert [r["full_fp32_bytes"] for r in rows] == expected
    assert [r["ratio_vs_full_fp32"] for r in rows] == pytest.approx(
        [expected[i] / on_disk[s] for i, s in enumerate((5, 10, 15))]
    )
    totals = report["totals"]
    assert totals["full_fp32_bytes_written"] == sum(expected)
    assert totals["ratio_vs_full_fp32"] == pytest.approx(sum(expected) / sum(on_disk.values()))
    # The figure: bars are the bytes on disk, the dashed baseline is the same files in fp32.
    fig = _figure(report)
    written, held = fig.axes[0], fig.axes[1]
    assert [bar.get_height() for bar in written.patches] == [on_disk[s] for s in (5, 10, 15)]
    (baseline,) = [line for line in written.get_lines() if "baseline" in line.get_label()]
    assert list(baseline.get_ydata())[1:] == expected
    (every,) = [line for line in held.get_lines() if "full fp32" in line.get_label()]
    assert list(every.get_ydata())[-1] == sum(expected)


# -- the page in a real browser -------------------------------------------------------------------
# Chromium from the system's packages (scripts/install_browser.sh installs Debian's), driven by
# Playwright. A missing browser fails the test with the way to install it: a skip would let a
# fresh machine pass without ever rendering the page.
BROWSER_HELP = (
    "run `bash scripts/install_browser.sh` (as root: apt-get install chromium) and "
    "`.venv/bin/pip install playwright`, or point EMBCKPT_CHROMIUM at a Chromium binary"
)
LONG_NAME = "a_checkpoint_folder_whose_name_is_long_enough_to_overflow_a_phone_screen_" * 2


def _chromium() -> str:
    """The Chromium binary: EMBCKPT_CHROMIUM, else the first one on PATH."""
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    found = os.environ.get("EMBCKPT_CHROMIUM") or next(filter(None, map(shutil.which, names)), None)
    if not found or not Path(found).exists():
        pytest.fail(f"no Chromium found to render the report page in: {BROWSER_HELP}")
    return found


@pytest.fixture(scope="module")
def browser() -> Any:
    """A headless Chromium for this module's tests."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"the Python package playwright is missing: {BROWSER_HELP}")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=_chromium(), headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def report_page(saved_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page of the one-shot run, with a projection, in a folder with a long unbroken name."""
    root = tmp_path_factory.mktemp("page")
    directory = root / LONG_NAME
    shutil.copytree(saved_runs / "one_shot", directory)
    page = root / "report.html"
    argv = ["report", str(directory), "--html", str(page), "--project", "--model-bytes", "2TB"]
    assert main(argv) == 0
    return page


# Scrolls every table box to its right end and returns, per table, the box's client and scroll
# widths and where the table's last header cell then lies on screen.
_TABLE_GEOMETRY = """() => [...document.querySelectorAll('table')].map(table => {
    const box = table.parentElement;
    box.scrollLeft = box.scrollWidth;
    const last = table.querySelector('tr').lastElementChild.getBoundingClientRect();
    const shown = table.getBoundingClientRect();
    return {box: box.className, client: box.clientWidth, scroll: box.scrollWidth,
            lastLeft: last.left, lastRight: last.right, height: shown.height};
})"""


@pytest.mark.parametrize(
    "width, mobile", [(400, True), (400, False), (1280, False)], ids=["phone", "400", "1280"]
)
def test_page_fits_the_screen_in_a_real_browser(
    browser: Any, report_page: Path, tmp_path: Path, width: int, mobile: bool
) -> None:
    # A phone lays the page out 980 px wide unless the viewport meta says otherwise, so the
    # phone case fails without it; the desktop cases catch overflow from content.
    context = browser.new_context(
        viewport={"width": width, "height": 900}, is_mobile=mobile, has_touch=mobile
    )
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(report_page.as_uri())
    page.wait_for_load_state("load")

    assert page.evaluate("document.documentElement.lang") == "en"
    viewport = page.locator("meta[name=viewport]").get_attribute("content") or ""
    assert "width=device-width" in viewport
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    assert page.evaluate("document.body.scrollWidth") <= width
    assert page.evaluate("window.innerWidth") == width
    # Every table is shown and, scrolled inside its own box, shows its last column on screen.
    tables = page.evaluate(_TABLE_GEOMETRY)
    assert len(tables) >= 4  # totals, checkpoints, tables, projection
    for table in tables:
        assert table["box"] == "scroll" and table["height"] > 0
        assert 0 <= table["lastLeft"] < table["lastRight"] <= width
    if width == 400:  # the checkpoint list is wider than a phone: its box scrolls, not the page
        assert any(t["scroll"] > t["client"] for t in tables)
    for cell in ("5", "10", "15", tm.table("rw")):
        assert page.get_by_role("cell", name=cell, exact=True).first.is_visible(), cell
    image = page.locator("img")
    assert image.evaluate("img => img.complete && img.naturalWidth") >= 800
    box = image.bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width
    assert LONG_NAME[:40] in page.locator("h1").inner_text().replace("\n", "")
    page.screenshot(path=str(tmp_path / f"report_{width}.png"), full_page=True)
    assert _png_size((tmp_path / f"report_{width}.png").read_bytes())[0] == width
    assert errors == []
    context.close()


# -- projection ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, size",
    [("2TB", 2 * 10**12), ("500GB", 500 * 10**9), ("1.5TiB", int(1.5 * 2**40)), ("7", 7)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text, seconds", [("30m", 1800), ("2h", 7200), ("1d", 86400)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["2XB", "TB", "-1GB"])
def test_parse_size_rejects(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["30", "0m", "3y"])
def test_parse_duration_rejects(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        parse_duration(bad)


def _checkpoint(kind: str, size: int, dirty: float, chain: int) -> dict[str, Any]:
    return {
        "kind": kind,
        "bytes": size,
        "full_fp32_bytes": 1000,
        "dirty_fraction": dirty,
        "restore_chain_bytes": chain,
        "tables": [{"bytes": size - 100}],
    }


def test_projection_follows_the_arithmetic() -> None:
    # Measured: fulls write 1.1x and 0.9x of fp32 (mean 1.0); diffs 0.3x and 0.5x (mean 0.4)
    # touching 20% and 30% of rows (mean 25%, so 1.6x fp32 per written row); half are full.
    report = {
        "checkpoints": [
            _checkpoint("full", 1100, 1.0, 1100),
            _checkpoint("diff", 300, 0.2, 1400),
            _checkpoint("diff", 500, 0.3, 1600),
            _checkpoint("full", 900, 1.0, 900),
        ]
    }
    p = project(report, model_bytes=2 * 10**12, interval_seconds=1800, days=1)
    assert p is not None
    assert p["checkpoints"] == 48  # 24 h / 30 min
    assert p["full_share"] == 0.5
    assert p["full_write_ratio"] == pytest.approx(1.0)
    assert p["diff_write_ratio"] == pytest.approx(0.4)
    assert p["touch_rate"] == pytest.approx(0.25) and p["touch_rate_source"] == "measured"
    assert p["row_write_ratio"] == pytest.approx(1.6)
    assert p["full_checkpoint_bytes"] == 2 * 10**12
    assert p["diff_checkpoint_bytes"] == 8 * 10**11
    assert p["mean_checkpoint_bytes"] == 14 * 10**11  # 0.5 * 1.0 + 0.5 * 0.4 = 0.7 of 2 TB
    assert p["mean_write_bytes_per_second"] == pytest.approx(14e11 / 1800)
    assert p["peak_write_bytes_per_second"] == pytest.approx(2e12 / 1800)
    assert p["bytes_written"] == p["storage_held_bytes"] == 48 * 14 * 10**11
    assert p["full_fp32_bytes_written"] == 48 * 2 * 10**12
    assert p["write_reduction"] == pytest.approx(1 / 0.7)
    assert p["restore_chain_bytes"] == 18 * 10**11  # the latest chain read 0.9x fp32
    assert p["dense_share"] == pytest.approx(400 / 2800)
    assert len(p["assumptions"]) >= 6

    given = project(report, 2 * 10**12, 1800, 1, touch_rate=0.5)
    assert given is not None and given["touch_rate_source"] == "given"
    assert given["diff_write_ratio"] == pytest.approx(0.8)  # 0.5 of rows at 1.6x
    assert given["mean_checkpoint_bytes"] == 18 * 10**11
    assert project({"checkpoints": []}, 10**12, 1800, 1) is None


def test_project_from_the_command_line(
    saved_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = saved_runs / "one_shot"
    argv = ["--project", "--model-bytes", "1.5TiB", "--interval", "2h", "--days", "1"]
    report = _report_json(directory, capsys, *argv)
    p, measured = report["projection"], report["checkpoints"]
    full = measured[0]["bytes"] / measured[0]["full_fp32_bytes"]
    diffs = [c["bytes"] / c["full_fp32_bytes"] for c in measured[1:]]
    mean_ratio = (full + sum(diffs)) / 3
    assert p["model_bytes"] == int(1.5 * 2**40) and p["interval_seconds"] == 7200
    assert p["checkpoints"] == 12
    assert p["mean_checkpoint_bytes"] == round(1.5 * 2**40 * mean_ratio)
    assert math.isclose(p["bytes_written"], 12 * 1.5 * 2**40 * mean_ratio, rel_tol=1e-9)
    page = tmp_path / "p.html"
    assert main(["report", str(directory), *argv, "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "Projection: a 1.65 TB model over 1 day<" in page.read_text()
    assert "projection for a 1.65 TB model over 1 day, assuming:" in out
    assert "one checkpoint every 2h, 12 in 1 day" in out and "write bandwidth" in out


def test_project_needs_a_model_size(saved_runs: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(saved_runs / "one_shot"), "--project"]) == 2
    assert "--model-bytes" in capsys.readouterr().err


# -- the demo keeps its report next to the checkpoints ---------------------------------------------
def test_demo_out_folder_accepts_its_own_report(tmp_path: Path) -> None:
    from embckpt.examples.demo import REPORT_FILES, _prepare_out

    out = tmp_path / "demo"
    (out / "step_000000000010").mkdir(parents=True)
    for name in REPORT_FILES:
        (out / name).write_bytes(b"x")
    _prepare_out(out)
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="notes.txt"):
        _prepare_out(out)
    shutil.rmtree(out)


def test_a_filesystem_uri_reports_the_same(saved_runs: Path) -> None:
    directory = saved_runs / "incremental"
    by_path = build_report(CheckpointStore(directory))
    by_uri = build_report(CheckpointStore(directory.as_uri()))
    assert by_uri["directory"].startswith("file://")
    assert by_uri["totals"] == by_path["totals"]
    assert by_uri["checkpoints"] == by_path["checkpoints"]
