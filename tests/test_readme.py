"""README.md as the entry point: it opens with the two setup commands and then says what
kvtrace is; the demo and a runnable example come early; its Python quickstart runs as written; the
format version it states is the spec's; its picture exists and is the one scripts/readme_figure.py
draws; every detector has its line; it stays short. The shell examples run in tests/test_examples.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvtrace

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
OPENING = """# kvtrace

```bash
bash scripts/demo.sh     # fresh venv (CPU torch 2.13.0) + `kvtrace demo`: record a hybrid sliding-window model, analyse, report
bash scripts/test.sh     # fresh venv + ruff + the whole test suite (what CI runs via .ci/run)
```

kvtrace records the KV cache of Hugging Face Transformers models"""


def test_opens_with_the_two_commands_then_what_kvtrace_is():
    assert README.startswith(OPENING)


def test_the_demo_and_runnable_examples_come_first():
    sections = [m.start() for m in re.finditer(r"^## ", README, flags=re.M)]
    assert README.index("\nkvtrace demo ") < sections[0] + 200  # in the first section
    assert README.index("```python") < README.index("## Install")
    assert README.index("```python") < len(README) // 3


def test_stated_format_version_is_the_specs():
    spec = (ROOT / "spec" / "kvtrace-format.md").read_text(encoding="utf-8")
    (spec_version,) = re.findall(r"^# kvtrace trace format — version (\d+\.\d+) \(normative\)", spec, flags=re.M)
    stated = re.findall(r"normative spec \(version (\d+\.\d+)\)", README)
    assert stated == [spec_version] == [kvtrace.FORMAT_VERSION]
    # no other "format X.Y" / "version X.Y" claim about the trace format that could drift
    assert not re.findall(r"format (?:version )?1\.\d\b", README.replace(f"version {spec_version}", ""))


def test_the_picture_is_the_scripts_and_exists():
    links = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", README)
    assert len(links) == 1
    picture = ROOT / links[0]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_figure", ROOT / "scripts" / "readme_figure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; main() draws
    assert module.PICTURE == picture  # the script that draws it writes exactly this file


def test_every_detector_has_its_line():
    import importlib
    import pkgutil

    import kvtrace.analyzer.detectors as detectors
    from kvtrace.analyzer.base import REGISTRY

    for module in pkgutil.iter_modules(detectors.__path__):
        importlib.import_module(f"kvtrace.analyzer.detectors.{module.name}")
    section = README[README.index("## What it finds"):README.index("## Install")]
    listed = re.findall(r"^- `([a-z_]+)`: ", section, flags=re.M)
    assert sorted(listed) == sorted(REGISTRY), set(listed) ^ set(REGISTRY)


def test_short():
    words = len(README.split())
    assert words <= 1250, f"README.md has {words} words (an entry point of about 1,200)"


@pytest.mark.slow
def test_python_quickstart_runs_as_written(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("pandas")
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "README.md has no Python example"
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
    assert "layer_type" in proc.stdout and "full" in proc.stdout and "sliding" in proc.stdout
    assert (tmp_path / "run.kvt.h5").exists()
