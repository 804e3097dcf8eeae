"""The analyser and its CLI run where torch cannot be imported."""

import subprocess
import sys
import textwrap

from tests.helpers.synth import GPT_OSS_LIKE, Req, build

BLOCK = textwrap.dedent("""
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch.") or name == "transformers" or name.startswith("transformers."):
                raise ImportError(f"{name} is blocked for this test")
            return None
    sys.meta_path.insert(0, _NoTorch())
""")


def test_analyzer_imports_and_runs_without_torch(tmp_path):
    trace = build(tmp_path / "t.kvt.h5", GPT_OSS_LIKE, [Req(64, 8)], gpu=True)
    code = BLOCK + textwrap.dedent(f"""
        import kvtrace, kvtrace.analyzer, kvtrace.analyzer.diff, kvtrace.analyzer.terminal
        from kvtrace.analyzer import detector_names
        from kvtrace.analyzer.detectors._serving import NO_SCHED
        r = kvtrace.analyze({str(trace)!r})
        # a generate() trace: every detector runs but the serving ones, which say why they skip
        assert all(x.status == "ran" or x.reason == NO_SCHED for x in r.results), [(x.name, x.reason) for x in r.results]
        assert sum(x.status == "ran" for x in r.results) == 10
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        from kvtrace.cli import main
        try:
            main(["analyze", {str(trace)!r}, "--json", "-"])
        except SystemExit as e:
            assert e.code in (0, None), e.code
        try:
            main(["diff", {str(trace)!r}, {str(trace)!r}])
        except SystemExit as e:
            assert e.code in (0, None), e.code
        assert "torch" not in sys.modules
        print("OK", len(detector_names()))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "OK 18" in p.stdout
