"""docs/presets.md carries the generated preset table, up to date."""

from __future__ import annotations

from pathlib import Path

from kvtrace import presets as P

DOC = Path(__file__).resolve().parents[2] / "docs" / "presets.md"


def test_doc_table_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert P.presets_markdown() in text, "regenerate docs/presets.md with kvtrace.presets.presets_markdown()"
    for name in P.list_presets():
        assert f"`{name}`" in text
    assert " GB" not in text and " MB" not in text  # binary units only
