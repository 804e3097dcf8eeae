"""kvtrace.progress: one helper, lines that arrive when a step starts (no silent minutes).

The demo is run as a user's pipe would see it: stdout read line by line while the process runs.
Nothing here asserts how long a step takes; only that each milestone line was read before the
process ended (so it was flushed when it was written, not at exit), and in order."""

from __future__ import annotations

import pytest

from kvtrace.progress import Milestones, progress_bar
from tests.helpers.gated_run import Gated


def test_a_piped_step_line_is_out_before_the_step_runs(capsys):
    m = Milestones()
    with m.step("loading the model"):
        assert capsys.readouterr().out == "loading the model ...\n"  # already written when the work starts
    m.say("done")
    assert capsys.readouterr().out == "done\n"


def test_steps_on_stderr_and_quiet(capsys):
    with Milestones(err=True).step("analysing"):
        pass
    out = capsys.readouterr()
    assert out.out == "" and out.err == "analysing ...\n"
    quiet = Milestones(enabled=False)
    with quiet.step("x"):
        quiet.say("y")
    assert capsys.readouterr() == ("", "")


def test_a_terminal_step_leaves_one_line_with_its_duration(capsys):
    with Milestones(terminal=True).step("recording"):
        pass
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("recording (") and lines[-1].endswith(("ms)", "s)"))


def test_the_old_import_path_still_works():
    from kvtrace.report.progress import progress_bar as old

    assert old is progress_bar


@pytest.mark.slow
def test_demo_prints_each_long_step_before_it_runs(tmp_path):
    """The model load, the analysis and the report each wait until the test has read the line that
    announces them: a line held in a buffer until exit would never be read (the step waits)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run = Gated(["kvtrace.loading:load_model", "kvtrace.analyzer:analyze", "kvtrace.report:write_report"],
                ["demo", "-o", str(tmp_path / "d")], tmp_path, env={"OMP_NUM_THREADS": "1", "COLUMNS": "120"})
    try:
        run.expect("importing torch and transformers ...")
        run.expect("loading preset:gpt-oss-20b (")
        run.open(0)
        run.expect("  request 0: 32 prompt tokens")
        run.expect("  request 1: 32 prompt tokens")
        run.expect("trace written to")
        run.expect("analysing demo.kvt.h5")
        assert not (tmp_path / "d" / "report.html").exists()
        run.open(1)
        run.expect("writing the HTML report")
        run.open(2)
        run.expect("HTML report: ")
        assert run.finish() == 0, run.other[-20:]
    finally:
        run.kill()
