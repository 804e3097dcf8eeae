"""Hostile fleets and SQL: a fleet directory is data someone else may have made.

Every case runs the CLI in-process and asserts: the documented exit code (never 70), one stderr
line and no traceback, no hang (a FIFO is refused or replaced, never opened and waited on), and
that no file changed anywhere under the test's directory except the command's own outputs (a
snapshot of every path, its type, content hash, inode and link target, before and after).

Surfaces: forged manifests (FORGED_MANIFESTS + the seeded manifest fuzzer), damaged or forged
fleet layouts (LAYOUTS), SQL that tries to write or read files (HOSTILE_SQL + the seeded SQL
fuzzer), DuckDB types through --json (JSON_TYPES), fleet diff's numbers (BAD_NUMBERS), and
exports stopped midway (killed, terminated, full disk). docs/accuracy.md "Hostile fleets and SQL"
counts them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtrace import exitcodes
from kvtrace.fleet.source import file_identity
from kvtrace.wholefile import _host_tag
from tests.fleet.conftest import make_trace
from tests.helpers.cli_run import run_main

REPO = Path(__file__).resolve().parents[2]
SECRET = "TOPSECRET-kvtrace-hostile-fleet"


class Hung(BaseException):
    """A command that blocked (on a FIFO, say): not caught by the CLI's guards."""


@contextlib.contextmanager
def deadline(seconds: int = 60) -> Iterator[None]:
    def hung(*_: object) -> None:
        raise Hung(f"no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under ``root`` (symlinks not followed): its type, and a regular file's content
    hash and inode (a file replaced by an equal copy counts as changed)."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_ino)
            else:
                out[rel] = (stat.S_IFMT(st.st_mode),)
    return out


def changes(before: dict[str, tuple[object, ...]], after: dict[str, tuple[object, ...]]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def cli(argv: list[str], capsys: pytest.CaptureFixture[str] | None) -> tuple[int, str, str]:
    """The CLI in-process; with ``capsys`` None, in a child process with a time limit (a read that
    blocks on a FIFO inside pyarrow's C++ never returns to Python, where the alarm would stop it)."""
    if capsys is None:
        try:
            res = subprocess.run([sys.executable, "-m", "kvtrace.cli", *argv], capture_output=True, text=True,
                                 timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        except subprocess.TimeoutExpired:
            raise AssertionError(f"hung: {argv}") from None
        code, out, err = res.returncode, res.stdout, res.stderr
    else:
        with deadline():
            code, out, err = run_main(argv, capsys)
    assert "Traceback" not in err and "Traceback" not in out, err
    assert code != exitcodes.INTERNAL, err
    if code not in (exitcodes.OK, exitcodes.FINDINGS):
        assert err.count("\n") == 1 and err.startswith("kvtrace: "), err
    return code, out, err


# ---- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two traces and the fleet of both (copied by each test that changes it)."""
    from kvtrace.fleet.export import export_parquet

    d = tmp_path_factory.mktemp("hostile-base")
    a = make_trace(d / "a.kvt.h5", transformers_version="5.17.0")
    b = make_trace(d / "b.kvt.h5", transformers_version="5.23.0", new_tokens=7)
    result = export_parquet([str(a), str(b)], d / "fleet")
    assert len(result.exported) == 2 and not result.failed
    return {"a": a, "b": b, "fleet": d / "fleet"}


@pytest.fixture
def work(base: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """tmp_path/: the traces, fleet/ (a copy of the base fleet), outside/ (files a hostile fleet
    points at: victim.txt, victim.parquet, secret.csv, a directory with a Parquet file), and the
    current directory cwd/ (where a relative path in SQL would land)."""
    for k in ("a", "b"):
        shutil.copy2(base[k], tmp_path / base[k].name)
    shutil.copytree(base["fleet"], tmp_path / "fleet")
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim.txt").write_text("victim: must stay byte-identical\n")
    pq.write_table(pa.table({"trace_id": ["ffffffffffffffff"], "x": [1]}), outside / "victim.parquet")
    shutil.copy(outside / "victim.parquet", outside / "dir" / "ffffffffffffffff.parquet")
    (outside / "secret.csv").write_text(f"secret\n{SECRET}\n")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return {"root": tmp_path, "a": tmp_path / base["a"].name, "b": tmp_path / base["b"].name,
            "fleet": tmp_path / "fleet", "outside": outside}


def trace_ids(fleet: Path) -> list[str]:
    return pq.read_table(fleet / "traces.parquet").column("trace_id").to_pylist()


def consistent(fleet: Path) -> None:
    """What a fleet holds after any run: no temporary, and no per-trace file of a trace that
    traces.parquet does not list."""
    ids = set(trace_ids(fleet)) if (fleet / "traces.parquet").exists() else set()
    for p in fleet.rglob("*"):
        assert not p.name.endswith(".part"), p
        if p.parent != fleet and p.suffix == ".parquet":
            assert p.stem in ids, p


# ---- forged manifests -------------------------------------------------------------------------------

ENTRY = {"size": 1, "mtime_ns": 1, "sha256_edges": "0" * 64, "trace_id": "0123456789abcdef"}
BAD_IDS = ["/etc/passwd", "{outside}/victim", "../../outside/victim", "../outside/victim", "..", ".", "",
           ".hidden", "a/b", "a\\b", "a\x00b", "ａｂｃｄ", "0123456789abcdeｆ", "abc\u0430", "abc\u200b",
           "abc\u202e", "x" * 129, None, 17, ["a"], {"a": 1}, True]


def _manifest_with(trace: Path, **entry: object) -> str:
    return json.dumps({"fleet_schema_version": "1.1", "traces": {str(trace.resolve()): {**ENTRY, **entry}}})


def _forged_manifests() -> list[tuple[str, Callable[[dict[str, Path]], str | bytes]]]:
    cases: list[tuple[str, Callable[[dict[str, Path]], str | bytes]]] = [
        (f"trace_id={i!r}"[:40], lambda w, i=i: _manifest_with(
            w["a"], trace_id=i.format(outside=w["outside"]) if isinstance(i, str) else i)) for i in BAD_IDS]
    cases += [
        ("list", lambda w: "[]"), ("string", lambda w: '"x"'), ("number", lambda w: "1"), ("null", lambda w: "null"),
        ("traces-list", lambda w: '{"traces": []}'), ("entry-number", lambda w: '{"traces": {"p": 1}}'),
        ("entry-list", lambda w: '{"traces": {"p": []}}'),
        ("version-number", lambda w: '{"fleet_schema_version": 1.1, "traces": {}}'),
        ("size-text", lambda w: _manifest_with(w["a"], size="1")),
        ("size-negative", lambda w: _manifest_with(w["a"], size=-1)),
        ("size-2**64", lambda w: _manifest_with(w["a"], size=2**64)),
        ("size-bool", lambda w: _manifest_with(w["a"], size=True)),
        ("size-nan", lambda w: _manifest_with(w["a"]).replace('"size": 1', '"size": NaN')),
        ("mtime-float", lambda w: _manifest_with(w["a"], mtime_ns=1.5)),
        ("sha-short", lambda w: _manifest_with(w["a"], sha256_edges="abc")),
        ("nested-200000", lambda w: "[" * 200_000 + "]" * 200_000),
        ("nested-in-entry", lambda w: '{"traces": {"p": ' + "[" * 200_000 + "]" * 200_000 + "}}"),
        ("digits-5000", lambda w: _manifest_with(w["a"]).replace('"size": 1', '"size": 1' + "0" * 5000)),
        ("not-utf8", lambda w: b'{"traces": {"\xff\xfe": 1}}'),
        ("truncated", lambda w: _manifest_with(w["a"])[:-7]),
    ]
    return cases


FORGED_MANIFESTS = _forged_manifests()


@pytest.mark.parametrize("name, make", FORGED_MANIFESTS, ids=[n for n, _ in FORGED_MANIFESTS])
def test_forged_manifest_is_a_damaged_fleet(work, capsys, name, make):
    """export parquet into a fleet whose manifest is forged: exit 2, one line, nothing written or
    removed anywhere (an absolute or ../ trace_id used to unlink <id>.parquet outside DIR)."""
    content = make(work)
    manifest = work["fleet"] / "_manifest.json"
    manifest.write_bytes(content if isinstance(content, bytes) else content.encode())
    for victim in ("victim.parquet", "dir/ffffffffffffffff.parquet"):
        assert (work["outside"] / victim).exists()
    shutil.copy(work["outside"] / "victim.parquet", work["fleet"] / "victim.parquet")  # DIR/<table>/../victim
    before = snapshot(work["root"])
    code, _, err = cli(["export", "parquet", str(work["a"]), "-o", str(work["fleet"]), "--force"], capsys)
    assert code == exitcodes.UNREADABLE and "_manifest.json" in err, err
    assert changes(before, snapshot(work["root"])) == []
    code, _, _ = cli(["fleet", str(work["fleet"]), "--sql", "SELECT count(*) AS n FROM kv", "--json"], capsys)
    assert code in (exitcodes.OK, exitcodes.UNREADABLE)  # the queries read only the manifest's version
    assert changes(before, snapshot(work["root"])) == []


def test_manifest_larger_than_the_bound_is_not_read(work, capsys):
    """A sparse manifest of 256 MiB + 1 byte: refused from its size, not parsed (nor held in memory)."""
    from kvtrace.fleet.layout import MAX_MANIFEST_BYTES

    with open(work["fleet"] / "_manifest.json", "r+b") as fh:
        fh.truncate(MAX_MANIFEST_BYTES + 1)
    before = snapshot(work["root"])
    code, _, err = cli(["export", "parquet", str(work["a"]), "-o", str(work["fleet"])], capsys)
    assert code == exitcodes.UNREADABLE and "more than" in err
    assert changes(before, snapshot(work["root"])) == []


def test_manifest_fuzzer(work, capsys):
    """Seeded random manifests: values of every JSON type, ids from a hostile alphabet, random
    nesting; each is either a manifest kvtrace accepts (the export then runs, exit 0) or a damaged
    fleet (exit 2). Never 70, never a file outside the fleet directory touched."""
    rng = random.Random(28)
    alphabet = list("abcdef0123456789./\\-_~ \x00\u0430\uff41\u202e") + ["..", "%2e%2e", "\n"]

    def value(depth: int = 0) -> object:
        makers: list[Callable[[], object]] = [
            lambda: None, lambda: True, lambda: rng.randrange(-2**70, 2**70), lambda: rng.random() * 1e30,
            lambda: "".join(rng.choices(alphabet, k=8)), lambda: float("nan"),
            lambda: [value(depth + 1) for _ in range(rng.randrange(3))],
            lambda: {str(rng.randrange(5)): value(depth + 1) for _ in range(rng.randrange(3))},
            lambda: {**ENTRY, rng.choice(list(ENTRY)): value(depth + 1)}]
        return makers[rng.randrange(len(makers) if depth < 4 else 6)]()

    def ident() -> str:
        return "".join(rng.choices(alphabet, k=rng.choice([1, 2, 16, 17, 130])))

    protected = snapshot(work["outside"])
    codes = set()
    for i in range(FUZZ_MANIFESTS):
        pick = rng.randrange(4)
        if pick == 0:
            doc: object = value()
        elif pick == 1:
            doc = {"fleet_schema_version": value(), "traces": {ident(): value()}}
        else:
            doc = {"fleet_schema_version": "1.1",
                   "traces": {str(work["a"].resolve()) if pick == 2 else ident(): {**ENTRY, "trace_id": ident()}}}
        (work["fleet"] / "_manifest.json").write_text(json.dumps(doc))
        code, _, _ = cli(["export", "parquet", str(work["a"]), "-o", str(work["fleet"])], capsys)
        codes.add(code)
        assert code in (exitcodes.OK, exitcodes.UNREADABLE, exitcodes.VERSION), (i, doc)
        assert snapshot(work["outside"]) == protected, (i, doc)
        consistent(work["fleet"])
    assert exitcodes.UNREADABLE in codes


FUZZ_MANIFESTS = 100


# ---- forged and damaged layouts -----------------------------------------------------------------------


def _fifo(p: Path) -> None:
    p.unlink(missing_ok=True)
    os.mkfifo(p)


def _retyped_ids(w: dict[str, Path], ids: list[object]) -> None:
    t = pq.read_table(w["fleet"] / "traces.parquet")
    pq.write_table(t.set_column(0, "trace_id", pa.array(ids[: t.num_rows], pa.string())), w["fleet"] / "traces.parquet")


def _kv_file(w: dict[str, Path]) -> Path:
    return sorted((w["fleet"] / "kv").glob("*.parquet"))[0]


def _replace_with_dir(p: Path) -> None:
    p.unlink()
    p.mkdir()


# (name, change the fleet, exit of `export parquet A --force`, exit of `fleet --sql ... FROM kv`)
LAYOUTS: list[tuple[str, Callable[[dict[str, Path]], object], int, int]] = [
    ("manifest-symlink-to-victim", lambda w: ((w["fleet"] / "_manifest.json").unlink(),
                                              (w["fleet"] / "_manifest.json").symlink_to(w["outside"] / "victim.txt")),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("manifest-symlink-dangling", lambda w: ((w["fleet"] / "_manifest.json").unlink(),
                                             (w["fleet"] / "_manifest.json").symlink_to(w["outside"] / "nothing")),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("manifest-fifo", lambda w: _fifo(w["fleet"] / "_manifest.json"), exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("manifest-directory", lambda w: _replace_with_dir(w["fleet"] / "_manifest.json"),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-directory", lambda w: _replace_with_dir(w["fleet"] / "traces.parquet"),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-fifo", lambda w: _fifo(w["fleet"] / "traces.parquet"), exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-symlink", lambda w: ((w["fleet"] / "traces.parquet").unlink(),
                                  (w["fleet"] / "traces.parquet").symlink_to(w["outside"] / "victim.parquet")),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-empty", lambda w: (w["fleet"] / "traces.parquet").write_bytes(b""),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-no-trace_id", lambda w: pq.write_table(pa.table({"x": [1]}), w["fleet"] / "traces.parquet"),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-id-dotdot", lambda w: _retyped_ids(w, ["../outside/victim", "x"]),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-id-absolute", lambda w: _retyped_ids(w, ["/etc/passwd", "x"]), exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-id-null", lambda w: _retyped_ids(w, [None, "x"]), exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("traces-id-confusable", lambda w: _retyped_ids(w, ["０１２３４５６７８９ａｂｃｄｅｆ", "x"]),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("table-dir-symlink", lambda w: (shutil.rmtree(w["fleet"] / "kv"), (w["fleet"] / "kv").symlink_to(w["outside"] / "dir")),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("table-dir-file", lambda w: (shutil.rmtree(w["fleet"] / "kv"), (w["fleet"] / "kv").write_text("x")),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("table-dir-fifo", lambda w: (shutil.rmtree(w["fleet"] / "kv"), os.mkfifo(w["fleet"] / "kv")),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("old-traces-dir-symlink", lambda w: (w["fleet"] / "traces").symlink_to(w["outside"] / "dir"),
     exitcodes.UNREADABLE, exitcodes.OK),
    ("foreign-parquet", lambda w: shutil.copy(w["outside"] / "victim.parquet", w["fleet"] / "kv" / "foreign.parquet"),
     exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    # an id of kvtrace's own shape that nothing lists: what a killed export leaves; export removes it
    ("unlisted-own-id", lambda w: shutil.copy(_kv_file(w), w["fleet"] / "kv" / "0000000000000000.parquet"),
     exitcodes.OK, exitcodes.UNREADABLE),
    ("listed-symlink-to-victim", lambda w: _kv_file_link(w), exitcodes.OK, exitcodes.UNREADABLE),
    ("listed-hardlink", lambda w: (_kv_path(w).unlink(), os.link(w["outside"] / "victim.parquet", _kv_path(w))),
     exitcodes.OK, exitcodes.OK),
    ("listed-fifo", lambda w: _fifo(_kv_path(w)), exitcodes.OK, exitcodes.UNREADABLE),
    ("listed-directory", lambda w: _replace_with_dir(_kv_path(w)), exitcodes.UNREADABLE, exitcodes.UNREADABLE),
    ("listed-junk", lambda w: _kv_path(w).write_bytes(b"PAR1 junk"), exitcodes.OK, exitcodes.UNREADABLE),
    ("leftover-part-dead-pid", lambda w: _part(w, _host_tag(), 0), exitcodes.OK, exitcodes.OK),
    ("leftover-part-other-host-old", lambda w: _part(w, "00000000", 7200), exitcodes.OK, exitcodes.OK),
]


def _part(w: dict[str, Path], host: str, age_s: float) -> None:
    """A temporary a killed writer left: of this host and a pid that is not running, or of another
    host and older than the staleness bound."""
    p = w["fleet"] / "kv" / f".{_kv_path(w).name}.{host}.999999999.0badc0de.part"
    p.write_bytes(b"PAR1 half")
    os.utime(p, (time.time() - age_s, time.time() - age_s))


def _kv_path(w: dict[str, Path]) -> Path:
    """The kv file of trace a (the one the export is given again)."""
    return w["fleet"] / "kv" / f"{file_identity(w['a'])['trace_id']}.parquet"


def _kv_file_link(w: dict[str, Path]) -> None:
    _kv_path(w).unlink(missing_ok=True)
    _kv_path(w).symlink_to(w["outside"] / "victim.parquet")


@pytest.mark.parametrize("name, damage, export_code, query_code", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_damaged_layout(work, capsys, name, damage, export_code, query_code):
    """Each forged layout: `fleet --sql` (reads) and `export parquet --force` (writes) answer with
    their code and never touch a file outside the fleet directory (the victims byte-identical, a
    hard link's other name keeping its content); a FIFO never blocks them."""
    damage(work)
    capsys = None if "fifo" in name else capsys  # a regression would block in C: a child with a time limit
    outside = snapshot(work["outside"])
    before = snapshot(work["root"])
    code, _, err = cli(["fleet", str(work["fleet"]), "--sql", "SELECT count(*) AS n FROM kv", "--json"], capsys)
    assert code == query_code, err
    assert changes(before, snapshot(work["root"])) == []  # a query writes nothing, anywhere
    code, _, err = cli(["export", "parquet", str(work["a"]), "-o", str(work["fleet"]), "--force", "--json"], capsys)
    assert code == export_code, err
    assert snapshot(work["outside"]) == outside
    if export_code == exitcodes.UNREADABLE:
        assert changes(before, snapshot(work["root"])) == []  # refused: nothing written or removed
    else:  # exported: the fleet is whole again, every file in it a regular file kvtrace made
        consistent(work["fleet"])
        code, out, err = cli(["fleet", str(work["fleet"]), "--sql", "SELECT count(*) AS n FROM kv", "--json"], capsys)
        assert code == exitcodes.OK and json.loads(out)["result"][0]["n"] > 0, err
        assert all(p.is_file() and not p.is_symlink() for p in (work["fleet"] / "kv").iterdir())


def test_outputs_of_fleet_commands_never_inside_or_through(work, capsys):
    """fleet report's -o may be a symlink the user named (written in place, as any tool's -o);
    the page is never written into the fleet directory."""
    before = snapshot(work["fleet"])
    code, _, err = cli(["fleet", "report", str(work["fleet"]), "-o", str(work["fleet"] / "kv" / "r.html")], capsys)
    assert code == exitcodes.USAGE, err
    assert snapshot(work["fleet"]) == before


# ---- SQL that cannot write or read elsewhere ----------------------------------------------------------

# {fleet}: the fleet directory, {out}: a directory outside it, {secret}: a CSV outside it.
HOSTILE_SQL = [
    "COPY traces TO '{fleet}/traces.parquet' (FORMAT parquet)",
    "COPY (SELECT 1 AS x) TO '{out}/copy.csv'",
    "COPY (SELECT 1 AS x) TO 'relative.csv'",
    "COPY traces FROM '{secret}'",
    "EXPORT DATABASE '{out}/db'",
    "ATTACH '{out}/a.duckdb' AS a",
    "ATTACH ':memory:' AS m",
    "DETACH memory",
    "INSTALL httpfs",
    "LOAD httpfs",
    "LOAD '{out}/evil.duckdb_extension'",
    "UPDATE EXTENSIONS",
    "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{out}/explain.csv'",
    "EXPLAIN ANALYZE COPY traces TO '{fleet}/traces.parquet' (FORMAT parquet)",
    "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO 'relative.csv'",
    "EXPLAIN COPY (SELECT 1 AS x) TO '{out}/explain2.csv'",
    "EXPLAIN ANALYZE SELECT * FROM read_csv('{secret}')",
    "PRAGMA enable_profiling = 'json'",
    "PRAGMA profiling_output = '{out}/profile.json'",
    "SET enable_external_access = true",
    "RESET enable_external_access",
    "SET profiling_output = '{out}/profile.json'",
    "SET temp_directory = '{out}/tmp'",
    "SELECT * FROM read_csv('{secret}')",
    "SELECT * FROM read_csv_auto('{secret}')",
    "SELECT * FROM read_text('{secret}')",
    "SELECT * FROM read_blob('{secret}')",
    "SELECT * FROM read_json_auto('{secret}')",
    "SELECT * FROM read_parquet('{out}/victim.parquet')",
    "SELECT * FROM parquet_scan('{fleet}/traces.parquet')",
    "SELECT * FROM parquet_metadata('{fleet}/traces.parquet')",
    "SELECT * FROM sniff_csv('{secret}')",
    "SELECT * FROM glob('{out}/*')",
    "SELECT * FROM '{secret}'",
    "FROM '{out}/victim.parquet'",
    "SELECT * FROM query('SELECT * FROM read_csv(''{secret}'')')",
    "WITH s AS (SELECT * FROM read_text('{secret}')) SELECT * FROM s",
    "SELECT (SELECT content FROM read_text('{secret}')) AS c",
    "SELECT count(*) FROM traces WHERE EXISTS (SELECT * FROM read_csv('{secret}'))",
    "SUMMARIZE SELECT * FROM read_csv('{secret}')",
    "DESCRIBE SELECT * FROM read_parquet('{out}/victim.parquet')",
    "SELECT getenv('HOME')",
    "SELECT * FROM os",
    "SELECT * FROM con",
    "CREATE TABLE t AS SELECT * FROM traces",
    "CREATE OR REPLACE TABLE traces AS SELECT 1 AS x",
    "CREATE MACRO m() AS 1",
    "CREATE MACRO r(p) AS TABLE SELECT * FROM read_text(p)",
    "CREATE VIEW v AS SELECT * FROM read_csv('{secret}')",
    "CREATE SECRET s (TYPE s3, KEY_ID 'a', SECRET 'b')",
    "INSERT INTO traces SELECT * FROM traces",
    "UPDATE traces SET path = 'x'",
    "DELETE FROM traces",
    "DROP VIEW kv",
    "ALTER TABLE traces ADD COLUMN y INTEGER",
    "CALL pragma_version()",
    "CHECKPOINT",
    "VACUUM",
    "BEGIN TRANSACTION",
    "PREPARE p AS SELECT 1",
    "EXECUTE p",
    "USE memory",
    "PIVOT traces ON model_type USING count(*)",
    "SELECT 1; COPY (SELECT 1 AS x) TO '{out}/second.csv'",
    "SELECT 1; SELECT 2",
    "COPY (SELECT 1 AS x) TO '{out}/first.csv'; SELECT 1",
]


def _sql(template: str, w: dict[str, Path]) -> str:
    return template.format(fleet=w["fleet"], out=w["outside"], secret=w["outside"] / "secret.csv")


@pytest.mark.parametrize("template", HOSTILE_SQL)
def test_hostile_sql_writes_and_reads_nothing(work, capsys, template):
    """Every statement kind that could write or read a file: exit 64 with one line (refused by
    statement type before DIR is opened, or failing inside DuckDB, which has no file system
    access), no file created or changed anywhere, traces.parquet untouched (same inode), and the
    secret never printed."""
    before = snapshot(work["root"])
    sql = _sql(template, work)
    code, out, err = cli(["fleet", str(work["fleet"]), "--sql", sql, "--json"], capsys)
    assert code == exitcodes.USAGE, (sql, code, out, err)
    assert SECRET not in out and SECRET not in err
    assert changes(before, snapshot(work["root"])) == []


def test_reads_still_work_behind_the_lock(work, capsys):
    """The views over the fleet's own files still answer once file access is off."""
    sql = ("SELECT (SELECT count(*) FROM traces) AS t, (SELECT count(*) FROM kv) AS k, "
           "(SELECT count(*) FROM findings) AS f, (SELECT count(*) FROM payloads) AS p")
    code, out, err = cli(["fleet", str(work["fleet"]), "--sql", sql, "--json"], capsys)
    row = json.loads(out)["result"][0]
    assert code == 0 and row["t"] == 2 and row["k"] > 0 and row["p"] == 0, err
    code, out, err = cli(["fleet", str(work["fleet"]), "--sql", "SELECT current_setting('enable_external_access') "
                          "AS e, current_setting('lock_configuration') AS l", "--json"], capsys)
    assert json.loads(out)["result"] == [{"e": False, "l": True}]


def test_sql_fuzzer(work, capsys):
    """Seeded combinations of what reads or writes files (table functions, COPY targets, ATTACH)
    with paths inside and outside the fleet, inside SELECT, WITH, subqueries and EXPLAIN [ANALYZE]:
    always exit 64, never a file touched, never the secret shown."""
    rng = random.Random(2828)
    targets = ["{fleet}/traces.parquet", "{fleet}/kv/x.parquet", "{out}/f.csv", "{secret}", "rel.csv",
               "{fleet}/../outside/secret.csv", "/proc/self/environ", "{out}/victim.parquet"]
    readers = ["read_csv", "read_csv_auto", "read_text", "read_blob", "read_parquet", "read_json", "read_ndjson",
               "parquet_schema", "glob", "sniff_csv", "read_json_objects"]
    wrappers = ["SELECT * FROM {r}", "WITH q AS (SELECT * FROM {r}) SELECT * FROM q",
                "SELECT count(*) FROM traces, (SELECT * FROM {r}) s", "EXPLAIN SELECT * FROM {r}",
                "EXPLAIN ANALYZE SELECT * FROM {r}", "SELECT * FROM traces WHERE path IN (SELECT * FROM {r})"]
    writers = ["COPY (SELECT * FROM traces) TO '{t}'", "EXPLAIN ANALYZE COPY (SELECT * FROM traces) TO '{t}'",
               "EXPLAIN ANALYZE COPY traces TO '{t}' (FORMAT parquet)", "ATTACH '{t}' AS x", "EXPORT DATABASE '{t}'"]
    before = snapshot(work["root"])
    for i in range(FUZZ_SQL):
        t = rng.choice(targets)
        if rng.random() < 0.6:
            sql = rng.choice(wrappers).format(r=f"{rng.choice(readers)}('{t}')")
        else:
            sql = rng.choice(writers).format(t=t)
        sql = _sql(sql, work)
        code, out, err = cli(["fleet", str(work["fleet"]), "--sql", sql, "--json"], capsys)
        assert code == exitcodes.USAGE, (i, sql, err)
        assert SECRET not in out + err, sql
    assert changes(before, snapshot(work["root"])) == []


FUZZ_SQL = 80


# ---- every DuckDB type through --json -------------------------------------------------------------------

JSON_TYPES = [
    ("1.25::DECIMAL(10,2)", 1.25),
    ("12345678901234567890123456789012345678::DECIMAL(38,0)", 12345678901234567890123456789012345678),
    ("DATE '2024-01-02'", "2024-01-02"),
    ("TIMESTAMP '2024-01-02 03:04:05.123456'", "2024-01-02T03:04:05.123456"),
    ("TIMESTAMP_NS '2024-01-02 03:04:05'", "2024-01-02T03:04:05"),
    ("TIMESTAMPTZ '2024-01-02 03:04:05+02'", "2024-01-02T01:04:05+00:00"),
    ("TIME '12:34:56'", "12:34:56"),
    ("TIMETZ '12:00:00+05'", "12:00:00+05:00"),
    ("INTERVAL '2 days 3 hours'", 183600.0),
    ("'0bdbfa74-a160-4ea6-a1bc-d65ec49b9a20'::UUID", "0bdbfa74-a160-4ea6-a1bc-d65ec49b9a20"),
    ("'\\xAA\\x00'::BLOB", "qgA="),
    ("[1, 2, NULL]", [1, 2, None]),
    ("[[1.5], []]", [[1.5], []]),
    ("{'a': 1, 'b': [1.5::DECIMAL(3,1)]}", {"a": 1, "b": [1.5]}),
    ("MAP {'k': 1}", {"k": 1}),
    ("MAP {1: 'x', 2: 'y'}", [{"key": 1, "value": "x"}, {"key": 2, "value": "y"}]),
    ("MAP {[1]: 2}", [{"key": [1], "value": 2}]),
    ("170141183460469231731687303715884105727::HUGEINT", 170141183460469231731687303715884105727),
    ("18446744073709551615::UBIGINT", 18446744073709551615),
    ("'nan'::DOUBLE", None),
    ("'inf'::DOUBLE", None),
    ("'-inf'::FLOAT", None),
    ("'101'::BITSTRING", "101"),
    ("union_value(k := 1)", 1),
    ("'a'::ENUM ('a', 'b')", "a"),
    ("NULL::INTEGER", None),
    ("[{'t': DATE '2024-01-01', 'u': NULL}]", [{"t": "2024-01-01", "u": None}]),
]


def test_every_duckdb_type_converts_for_json(base, capsys):
    """One query holding every type: each column as documented (spec/fleet.md "--json")."""
    cols = ", ".join(f"{expr} AS c{i}" for i, (expr, _) in enumerate(JSON_TYPES))
    code, out, err = cli(["fleet", str(base["fleet"]), "--sql", f"SELECT {cols}", "--json"], capsys)
    assert code == 0, err
    row = json.loads(out)["result"][0]
    for i, (expr, want) in enumerate(JSON_TYPES):
        assert row[f"c{i}"] == want, expr


@pytest.mark.parametrize("sql", ["SUMMARIZE traces", "SUMMARIZE kv", "SUMMARIZE findings", "DESCRIBE traces",
                                 "SELECT * FROM traces", "SELECT * FROM kv LIMIT 5", "SELECT 1 AS a, 2 AS a",
                                 "SELECT list_value(" + ", ".join(["1"] * 500) + ") AS l"])
def test_documented_queries_answer_as_json(base, capsys, sql):
    code, out, err = cli(["fleet", str(base["fleet"]), "--sql", sql, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)  # strict JSON: no NaN token
    json.dumps(doc, allow_nan=False)
    if sql.startswith("SELECT 1 AS a"):
        assert doc["result"] == [{"a": 1, "a_2": 2}]


# ---- fleet diff's numbers -----------------------------------------------------------------------------------

BAD_NUMBERS = [("--alpha", v) for v in ("nan", "-nan", "inf", "-inf", "0", "1", "-0.5", "1.5")] + \
              [("--min-effect", v) for v in ("nan", "inf", "-1")]


@pytest.mark.parametrize("option, value", BAD_NUMBERS)
def test_diff_refuses_numbers_out_of_range(base, capsys, option, value):
    code, _, err = cli(["fleet", "diff", str(base["fleet"]), "--baseline", "transformers_version=5.17.0",
                        "--candidate", "transformers_version=5.23.0", option, value], capsys)
    assert code == exitcodes.USAGE and option in err, err


# ---- exports stopped midway --------------------------------------------------------------------------------

STALL = textwrap.dedent("""
    import sys, time
    import pyarrow.parquet as pq
    real = pq.write_table
    def stall(table, where, **kw):
        if "file_bytes" not in table.column_names:  # a per-trace table: half written, then wait
            where.write(b"PAR1 half")
            where.flush()
            open(sys.argv[1], "w").close()
            time.sleep(600)
        return real(table, where, **kw)
    pq.write_table = stall
    from kvtrace.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _stalled_export(tmp_path: Path, trace: Path, out: Path) -> subprocess.Popen[bytes]:
    """`export parquet TRACE -o OUT` in a child whose first per-trace table stops half written."""
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", STALL, str(ready), "export", "parquet", str(trace), "-o", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < 120, "the export never reached its first table"
        time.sleep(0.05)
    return proc


def test_killed_export_leaves_nothing_the_next_run_keeps(work, capsys):
    """SIGKILL in the middle of a table: its hidden temporary stays (nothing can run then), never
    under a final name; the next export removes it, and the fleet reads."""
    out = work["root"] / "killed"
    proc = _stalled_export(work["root"], work["b"], out)
    proc.kill()
    proc.communicate()
    parts = [p for p in out.rglob("*") if p.name.endswith(".part")]
    assert parts and not [p for p in out.rglob("*.parquet") if p.is_file()]  # hidden, not a *.parquet
    code, _, err = cli(["export", "parquet", str(work["b"]), "-o", str(out)], capsys)
    assert code == 0, err
    assert not [p for p in out.rglob("*") if p.name.endswith(".part")]
    consistent(out)
    code, _, err = cli(["fleet", str(out), "--sql", "SELECT count(*) FROM kv"], capsys)
    assert code == 0, err


def test_terminated_export_cleans_up_before_it_exits(work, fresh_trace):
    """SIGTERM in the middle of a table: exit 143, no temporary, and the fleet as it was."""
    before = snapshot(work["fleet"])
    proc = _stalled_export(work["root"], fresh_trace, work["fleet"])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and b"Traceback" not in err, err
    assert changes(before, snapshot(work["fleet"])) == []


@pytest.fixture
def fresh_trace(work: dict[str, Path]) -> Path:
    return make_trace(work["root"] / "c.kvt.h5", transformers_version="5.99.0", new_tokens=9)


@pytest.mark.parametrize("fails_at", ["table", "traces.parquet", "manifest"])
def test_full_disk_leaves_no_orphans(work, capsys, monkeypatch, fresh_trace, fails_at):
    """ENOSPC while a new trace's table, traces.parquet or the manifest is written: exit 73 in one
    line; no temporary, no per-trace file of a trace traces.parquet does not list, and - when the
    failure comes before traces.parquet is replaced - the directory exactly as before."""
    from kvtrace.fleet import export as fx

    real = fx.create_in_dir

    def full(root, rel, write):
        name = rel[-1]
        hit = {"table": len(rel) == 2 and name.startswith(file_identity(fresh_trace)["trace_id"]),
               "traces.parquet": name == "traces.parquet", "manifest": name == "_manifest.json"}[fails_at]
        if hit:
            def half(fh):
                fh.write(b"PAR1 half")
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(root, rel, half)
        return real(root, rel, write)

    monkeypatch.setattr(fx, "create_in_dir", full)
    before = snapshot(work["fleet"])
    code, _, err = cli(["export", "parquet", str(fresh_trace), "-o", str(work["fleet"])], capsys)
    assert code == exitcodes.CANNOT_WRITE and err.rstrip().endswith("No space left on device"), err
    consistent(work["fleet"])
    if fails_at != "manifest":
        assert changes(before, snapshot(work["fleet"])) == []
    code, _, err = cli(["fleet", str(work["fleet"]), "--sql", "SELECT count(*) FROM kv"], capsys)
    assert code == 0, err
    monkeypatch.setattr(fx, "create_in_dir", real)
    code, out, err = cli(["export", "parquet", str(fresh_trace), "-o", str(work["fleet"]), "--json"], capsys)
    assert code == 0 and len(json.loads(out)["exported"]) == 1, err


def test_second_export_into_the_same_directory_waits_for_none(work, capsys):
    """Two exports into one directory would overwrite each other's traces.parquet: the second is
    refused (73) while the first holds the directory's lock."""
    import fcntl

    fd = os.open(work["fleet"], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(work["fleet"])
        code, _, err = cli(["export", "parquet", str(work["b"]), "-o", str(work["fleet"]), "--force"], capsys)
        assert code == exitcodes.CANNOT_WRITE and "another kvtrace export" in err
        assert snapshot(work["fleet"]) == before
    finally:
        os.close(fd)
