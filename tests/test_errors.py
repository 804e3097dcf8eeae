"""One error model: every error kvtrace raises for the user is a KvtraceError that carries its exit
code, the code is one spec/cli.md documents, and the commands do not map classes to codes by hand.

The exception classes are found by reading the source (ast), so a new class in any module is seen
without being listed here; only the modules that define one are imported."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest

from kvtrace import exitcodes
from kvtrace.errors import BadOption, BundleError, CannotWrite, KvtraceError

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kvtrace"

# Exception classes that never reach the command line: the library catches each and says it with
# context (or as a row, a status, a note). Anything else must be a KvtraceError.
INTERNAL = {
    "UnsafeName": "wholefile: a name refused inside an output directory; callers say which output",
    "Unpredictable": "report/kvcheck: a layer geometry cannot size; the report says so in a note",
    "PresetTooLarge": "presets: loading.py turns it into Unavailable with the shrink hint",
    "_WriterStopped": "recorder/sampling: ends the writer thread's loop",
    "PolicyError": "whatif: the commands say it as a usage error of the option that named the policy",
    "Unsupported": "whatif: a unit the policy cannot support becomes a row saying why",
    "BoundBroken": "serving/client: a server past a bound fails that request (its status says which)",
    "NotOpenAI": "serving/openai_stream: an answer that does not parse fails that request",
    "BadBatch": "engines/vllm_events: a KV-event message that does not decode becomes a dropped_samples event",
    "NotRowDriven": "whatif/rerun_pass: the one pass cannot drive the model; the per-token loop runs, said in pass_note",
}


def documented_codes() -> dict[int, str]:
    """code -> NAME from the table under spec/cli.md "## Exit codes"."""
    text = (ROOT / "spec" / "cli.md").read_text(encoding="utf-8")
    table = text.split("\n## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(code): name for code, name in re.findall(r"^\| (\d+) \| `([A-Z_]+)` \|", table, re.M)}


def exception_classes() -> dict[str, str]:
    """Class name -> module of every exception class defined in kvtrace/ (a builtin exception or
    another such class among its bases, by name)."""
    defined: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                defined[node.name] = (module, bases)
    known = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    found: dict[str, str] = {}
    grew = True
    while grew:
        grew = False
        for name, (module, bases) in defined.items():
            if name not in found and any(b in known or b in found for b in bases):
                found[name] = module
                grew = True
    return found


def all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    for sub in cls.__subclasses__():
        out |= {sub} | all_subclasses(sub)
    return out


@pytest.fixture(scope="module")
def kvtrace_errors() -> set[type]:
    for module in sorted(set(exception_classes().values())):
        importlib.import_module(module)
    return all_subclasses(KvtraceError)


def test_the_documented_table_matches_exitcodes():
    documented = documented_codes()
    assert documented and documented == {getattr(exitcodes, n): n for n in documented.values()}


def test_every_error_is_a_kvtrace_error_or_stays_inside_the_library(kvtrace_errors):
    names = {c.__name__ for c in kvtrace_errors} | {"KvtraceError"}
    loose = sorted(set(exception_classes()) - names - set(INTERNAL))
    assert loose == [], f"exception classes that are neither KvtraceError nor listed in INTERNAL: {loose}"
    assert not names & set(INTERNAL)


def test_every_kvtrace_error_carries_a_documented_failure_code(kvtrace_errors):
    documented = documented_codes()
    # control: the scan reached the modules (an empty set would pass nothing)
    assert {"BrokenRankSet", "CannotServeMetrics", "FleetError", "ServerUnhealthy", "Stopped"} <= {
        c.__name__ for c in kvtrace_errors}
    for cls in kvtrace_errors:
        assert cls.exit_code in documented, (cls, cls.exit_code)
        assert cls.exit_code not in (exitcodes.OK, exitcodes.INTERNAL, exitcodes.FINDINGS), cls


def test_codes_the_format_writes_as_numbers_are_the_constants():
    # kvtrace/format imports nothing outside itself, so format/errors.py spells its codes as numbers
    from kvtrace.format import errors as fe

    assert fe.KvtraceError.exit_code == exitcodes.INTERNAL
    assert fe.TraceError.exit_code == fe.NotATrace.exit_code == exitcodes.UNREADABLE
    assert fe.InvalidTrace.exit_code == fe.CorruptChunk.exit_code == fe.LimitExceeded.exit_code == exitcodes.INVALID
    assert fe.UnsupportedVersion.exit_code == exitcodes.VERSION


def test_one_cannot_write_under_its_old_names():
    from kvtrace.errors import Unavailable
    from kvtrace.recorder import CannotWriteOutput, CannotWriteTrace
    from kvtrace.recorder.options import CannotServeMetrics

    assert CannotWriteOutput is CannotWrite and CannotWriteTrace is CannotWrite
    assert issubclass(CannotWrite, OSError) and str(CannotWrite("x: full")) == "x: full"
    assert issubclass(CannotServeMetrics, Unavailable) and issubclass(CannotServeMetrics, OSError)
    assert issubclass(BadOption, ValueError)


def test_a_bundle_error_takes_its_code_from_its_kind():
    assert BundleError("m").exit_code == exitcodes.USAGE
    assert BundleError("m", "invalid").exit_code == exitcodes.INVALID
    assert BundleError("m", "output").exit_code == exitcodes.CANNOT_WRITE


@pytest.mark.parametrize("make", [
    lambda: CannotWrite("out.html: cannot write report (No space left on device)"),
    lambda: BundleError("bundle: exists and is not an empty directory", "output"),
    lambda: importlib.import_module("kvtrace.fleet").FleetError("fleet: not a directory"),
    lambda: importlib.import_module("kvtrace.serving.client").ServerUnreachable("http://h:1: refused"),
    lambda: importlib.import_module("kvtrace.errors").ContentRefused("a.kvt.h5 holds prompt text"),
])
def test_guarded_says_the_message_and_exits_with_the_class_code(make, capsys):
    from kvtrace.commands.common import guarded

    exc = make()

    @guarded
    def command() -> None:
        raise exc

    with pytest.raises(SystemExit) as info:
        command()
    assert info.value.code == exc.exit_code
    assert capsys.readouterr().err == f"kvtrace: {exc}\n"


# ---- the commands: no hand-written class -> code translations --------------------------------------

def translations(source: str, error_names: set[str]) -> list[int]:
    """Lines of except clauses that only map an exception to an exit code: a body that is one
    ``fail(...)`` (then perhaps ``return``), or one ``raise K(str(exc))`` re-raising a KvtraceError
    under another KvtraceError class with the same message."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler):
            continue
        body = [s for s in node.body if not isinstance(s, ast.Return)]
        if len(body) != 1:
            continue
        stmt = body[0]
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and getattr(stmt.value.func, "id", None) == "fail"):
            found.append(node.lineno)
            continue
        caught = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        caught_names = {c.attr if isinstance(c, ast.Attribute) else getattr(c, "id", "") for c in caught}
        if (isinstance(stmt, ast.Raise) and isinstance(stmt.exc, ast.Call)
                and getattr(stmt.exc.func, "id", None) in error_names and caught_names <= error_names
                and len(stmt.exc.args) == 1 and not stmt.exc.keywords and ast.unparse(stmt.exc.args[0]) == f"str({node.name})"):
            found.append(node.lineno)
    return found


def test_the_scanner_sees_the_translations_it_forbids():
    # Control: a pass below means nothing unless these shapes are caught (and the clean twin is not).
    planted = (
        "try:\n    f()\nexcept FleetError as exc:\n    fail(str(exc), exitcodes.UNREADABLE)\n"
        "try:\n    f()\nexcept (ServerUnreachable, X) as exc:\n    fail(f'cannot: {exc}', 69)\n    return\n"
        "try:\n    f()\nexcept CannotServeMetrics as exc:\n    raise Unavailable(str(exc)) from None\n")
    clean = (
        "try:\n    f()\nexcept OSError as exc:\n    raise CannotWrite(f'cannot write {p}: {exc.strerror}') from None\n"
        "try:\n    f()\nexcept CannotWrite:\n    cleanup()\n    raise\n"
        "try:\n    f()\nexcept ImportError as exc:\n    raise Unavailable(str(exc)) from None\n")
    names = {"FleetError", "ServerUnreachable", "CannotServeMetrics", "Unavailable", "CannotWrite"}
    assert translations(planted, names) == [3, 7, 12]
    assert translations(clean, names) == []


def test_no_command_maps_an_exception_class_to_an_exit_code_by_hand(kvtrace_errors):
    # commands/common.py is where the mapping lives (guarded: KvtraceError, Ctrl-C, MemoryError)
    names = {c.__name__ for c in kvtrace_errors} | {"KvtraceError"}
    found = {str(p.relative_to(ROOT)): lines for p in sorted((PKG / "commands").glob("*.py"))
             if p.name != "common.py" and (lines := translations(p.read_text(encoding="utf-8"), names))}
    assert found == {}, "raise a KvtraceError (its class carries the exit code) instead of calling fail() here"
