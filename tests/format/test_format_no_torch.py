"""`import kvtrace`, reading, validating and `kvtrace info` work where torch cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from fmt_helpers import write_minimal

BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers", "triton"):
                raise ImportError(f"{name} blocked for this test")
            return None
    sys.meta_path.insert(0, _Block())
    """
)


def test_info_and_validate_without_torch(tmp_path):
    path = tmp_path / "m.kvt.h5"
    write_minimal(path)
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        import kvtrace, kvtrace.format, kvtrace.format.validate, kvtrace.cli
        from kvtrace.commands import info, validate
        t = kvtrace.open({str(path)!r})
        assert t.requests[:].shape == (1,)
        sys.argv = ["kvtrace", "info", "--json", {str(path)!r}]
        try:
            kvtrace.cli.main()
        except SystemExit as e:
            assert not e.code, e.code
        assert "torch" not in sys.modules
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"]["count"] == 1 and summary["model"]["id"] == "test/minimal"


def test_record_without_torch_says_what_is_missing():
    code = BLOCK_TORCH + "import kvtrace\ntry:\n    kvtrace.record(None, 'x.h5')\nexcept ImportError as e:\n    print('missing:', e)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "missing:" in proc.stdout and "pip install 'kvtrace[record]'" in proc.stdout
