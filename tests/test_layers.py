"""Layers only point down, so a change in one never reaches back up: format <- analyzer <-
renderers (report, export) <- commands, and format <- recorder. Read from the source with ast, so
a lazy import inside a function counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kvtrace"


def imported(path: Path, root: Path = PKG) -> set[str]:
    """Every module name a file imports, at any depth (relative imports resolved)."""
    names: set[str] = set()
    parts = path.relative_to(root.parent).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(parts[: len(parts) - node.level])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def offenders(folders: list[str], forbidden: tuple[str, ...], root: Path = PKG) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            bad = sorted(n for n in imported(path, root)
                         if any(n == f or n.startswith(f + ".") for f in forbidden))
            if bad:
                found[str(path.relative_to(root.parent))] = bad
    return found


def test_the_scanner_sees_lazy_and_relative_imports(tmp_path):
    # Control: the scanner must catch the shapes the real rule forbids, else a pass means nothing.
    root = tmp_path / "kvtrace"
    (root / "report").mkdir(parents=True)
    (root / "report" / "ok.py").write_text("from kvtrace.format import schema\nfrom . import data\n")
    (root / "report" / "bad.py").write_text(
        "def f():\n    from kvtrace.commands.common import fail\n    from ..commands import x\n")
    assert offenders(["report"], ("kvtrace.commands",), root) == {
        "kvtrace/report/bad.py": ["kvtrace.commands", "kvtrace.commands.common",
                                  "kvtrace.commands.common.fail", "kvtrace.commands.x"]}


def test_renderers_do_not_import_commands():
    assert offenders(["report", "export"], ("kvtrace.commands", "kvtrace.cli")) == {}


def test_analyzer_and_format_point_down_only():
    up = ("kvtrace.commands", "kvtrace.cli", "kvtrace.report", "kvtrace.export", "kvtrace.recorder")
    assert offenders(["format", "analyzer"], up) == {}


def test_recorder_does_not_import_renderers_or_analyzer():
    up = ("kvtrace.commands", "kvtrace.cli", "kvtrace.report", "kvtrace.export", "kvtrace.analyzer")
    assert offenders(["recorder"], up) == {}


def test_format_imports_no_torch():
    assert offenders(["format"], ("torch", "transformers", "triton")) == {}


def test_analyzer_imports_no_torch():
    assert offenders(["analyzer"], ("torch", "transformers", "triton")) == {}


def test_analyzer_reaches_the_kernels_through_one_entry():
    # kvtrace.kernels.compute (open_compute) is the one optional entry: it imports torch itself,
    # and only analyzer/contents calls it; no analyser module names another kernels module.
    found = offenders(["analyzer"], ("kvtrace.kernels",))
    assert sorted(found) == ["kvtrace/analyzer/contents.py"]
    assert all(n == "kvtrace.kernels.compute" or n.startswith("kvtrace.kernels.compute.")
               for n in found["kvtrace/analyzer/contents.py"]), found


def test_the_kernels_entry_imports_torch_only_when_called():
    # Control for the rule above: the entry module must not import torch at load time either.
    import subprocess
    import sys

    code = ("import sys, kvtrace.kernels.compute, kvtrace.analyzer.contents; "
            "assert 'torch' not in sys.modules, 'torch imported at load'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_kernel_config_imports_nothing_heavy():
    # kvtrace.kernels.whatif_config is loaded with the kernels entry (compute.py) and named by the
    # replay (whatif/): no torch, no triton, nothing of kvtrace -- the kernels read it, not the reverse.
    found = imported(PKG / "kernels" / "whatif_config.py")
    assert not any(n.split(".")[0] in ("torch", "triton") or n.startswith("kvtrace") for n in found), found


def test_triton_modules_are_private_to_the_kernels():
    # kvtrace/kernels/_triton_*.py are reached through the kernels' public modules (whatif.py,
    # compute.py, ...), which take the configuration; nothing else launches them.
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        if path.parent == PKG / "kernels":
            continue
        bad = sorted(n for n in imported(path) if n.startswith("kvtrace.kernels._triton"))
        if bad:
            found[str(path.relative_to(PKG.parent))] = bad
    assert found == {}


def test_model_loading_is_a_library_module():
    # kvtrace/loading.py (record, demo) raises kvtrace.errors; the CLI is the commands' business.
    bad = sorted(n for n in imported(PKG / "loading.py")
                 if n.split(".")[0] == "click" or n.startswith(("kvtrace.commands", "kvtrace.cli")))
    assert bad == []


def test_kvcheck_reads_through_the_reader_not_report_data():
    # report/data imports kvcheck (the growth curves' prediction); kvcheck reads /kv through the
    # reader's tables itself, so no import runs back up and the two modules form no cycle.
    found = imported(PKG / "report" / "kvcheck.py")
    assert not any(n.startswith("kvtrace.report") for n in found), found
    assert "kvtrace.format.reader" in found
    assert "kvtrace.report.kvcheck" in imported(PKG / "report" / "data.py")


def test_only_the_format_opens_hdf5_files():
    # One read side: every consumer (analyser, renderers, whatif, fleet, commands) reads a trace
    # through kvtrace.format's Trace and its tables; none opens or reads the HDF5 file itself.
    outside = [f.name for f in PKG.iterdir() if f.is_dir() and f.name not in ("format", "__pycache__")]
    found = offenders(outside, ("h5py",))
    found.update({str(p.relative_to(PKG.parent)): bad for p in sorted(PKG.glob("*.py"))
                  if (bad := sorted(n for n in imported(p) if n == "h5py" or n.startswith("h5py.")))})
    assert found == {}



def test_the_package_never_imports_test_code():
    # Test-only models, trace builders and planted cases live in tests/helpers; the installed
    # package must not need the checkout's tests/ to import.
    folders = [f.name for f in PKG.iterdir() if f.is_dir() and f.name != "__pycache__"]
    found = offenders(folders, ("tests",))
    found.update({str(p.relative_to(PKG.parent)): bad for p in sorted(PKG.glob("*.py"))
                  if (bad := sorted(n for n in imported(p) if n == "tests" or n.startswith("tests.")))})
    assert found == {}


def test_test_support_code_has_one_home():
    # tests/helpers is the one home of shared support code: no conftest puts another tests/
    # folder on sys.path so that modules there can be imported by bare name.
    tests = PKG.parent / "tests"
    edits = [str(p.relative_to(tests.parent)) for p in sorted(tests.rglob("conftest.py"))
             if "sys.path" in p.read_text(encoding="utf-8")]
    assert edits == []
    helpers = {p.stem for p in (tests / "helpers").glob("*.py")} - {"__init__"}
    assert {"models", "hfcache", "cli_run", "tracebuild", "synth", "synth_trace", "planted", "cases", "net"} <= helpers
