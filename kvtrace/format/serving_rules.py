"""Row rules of the continuous-batching tables and serving events (format 1.4, spec §4.15-4.17, §7).

One implementation for two callers: ``kvtrace validate`` lists every broken rule, and the reader
refuses a trace that breaks one the first time a consumer reads /sched, /sched_groups, /blocks or
/events (Trace.table), so that every command that reads them answers a damaged trace the same way
(exit 1) instead of printing a pool of -5 bytes or a request with -2^63 preempted tokens.

Only rules the recorder guarantees by construction are here (a false alarm would refuse a real
trace): sentinels (-1 = unknown; other negatives are damage), counts >= 0, blocks of >= 1 token and
byte, one row per (manager, step[, group[, request]]), steps of a manager in time order, a request's
blocks within its group's pool and its tokens within its blocks, and each
row's step and group present in the table above it (/blocks -> /sched_groups -> /sched, the order
the recorder appends and the writer flushes them, so a killed recording still satisfies it).
Token-level use may exceed the pool (blocks shared by prefix caching count for each request), and
a step's running requests may exceed /requests (requests the session did not record): not rules.
Every rule holds on the 37 continuous-batching recordings of tests/serving_detectors/serving_scenarios.py
(25 with transformers 5.23, 12 with 5.17, sliding and full groups, preemption, prefix hits, eviction).

Tables are read in blocks of rows keeping a few columns (memory bounded like validate's, spec §9).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.format import schema

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.format.reader import Trace

K = schema.EventKind
ROW_BLOCK = 1 << 16
# Columns whose "not recorded" value is -1 (spec §4.15-4.16); any other negative is damage.
SENTINEL = {
    "sched": ("starved", "max_batch_tokens", "pool_bytes", "free_bytes", "valid_bytes", "blocks_in_use",
              "blocks_cached", "tokens_cached"),
    "sched_groups": ("window", "blocks_total", "blocks_cached", "blocks_free"),
}
# Signed columns that count something and have no sentinel.
COUNTS = {
    "sched": ("prefix_hit_tokens", "prefix_hit_blocks", "evicted_blocks"),
    "sched_groups": ("blocks_in_use", "tokens_valid"),
}
POSITIVE = ("tokens_per_block", "bytes_per_block")  # /sched_groups: a block holds >= 1 position and byte
# Serving event kinds (1.4) -> the smallest value they carry (offloaded: -1 when the bytes are unknown).
EVENT_MIN = {K.SCHEDULED: 0, K.FIRST_TOKEN: None, K.PREEMPTED: 0, K.PREFIX_HIT: 0, K.BLOCK_EVICTED: 0,
             K.OFFLOADED: -1, K.PHASE: 0}
TABLES = ("sched", "sched_groups", "blocks", "events")  # a consumer reading one of them is guarded


MAX_MANAGER = (1 << 16) - 1  # the manager columns are uint16


def cb_args(text: str) -> dict[str, Any] | None:
    """The generate() arguments (a /requests gen_args JSON) of a continuous-batching request, which
    names its ``cb_request_id`` (spec §4.15); None for any other request, or text that is not a JSON
    object (nested past Python's stack included). ValueError when it names a ``manager`` that is not
    an index 0-65535: the request cannot be placed (checked where a command reads it, and by validate)."""
    try:
        value = json.loads(text) if text else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or "cb_request_id" not in value:
        return None
    manager = value.get("manager", 0)
    if isinstance(manager, bool) or not isinstance(manager, int) or not 0 <= manager <= MAX_MANAGER:
        raise ValueError(f"names manager {str(manager)[:40]!r}, not a continuous-batching manager index "
                         f"(0-{MAX_MANAGER})")
    return value


def cb_request_problems(trace: Trace) -> list[str]:
    """Continuous-batching requests whose gen_args name no valid manager (validate: every request's
    arguments are read, one small text read each)."""
    rows = trace.table("requests", check_codes=False)
    bad = []
    for r in rows[rows["gen_args_len"] > 0]:
        try:
            cb_args(trace.text(int(r["gen_args_off"]), int(r["gen_args_len"])))
        except ValueError as exc:
            bad.append(f"/requests request {int(r['request'])}'s gen_args {exc}")
    return bad[:1] + ([f"... and {len(bad) - 1} more such request(s)"] if len(bad) > 1 else [])


class _Found:
    """Broken rules in first-seen order: rule -> one line about its first offending row."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def first(self, rule: str, mask: np.ndarray) -> int | None:
        """The first row where `mask` breaks `rule`, unless the rule is already noted (then None)."""
        if rule in self.rules or not np.any(mask):
            return None
        return int(np.flatnonzero(mask)[0])

    def flag(self, rule: str, mask: np.ndarray, message: Callable[[int], str]) -> None:
        """Note `rule` broken where `mask` holds; message(i) describes row i, the first such row."""
        i = self.first(rule, mask)
        if i is not None:
            self.rules[rule] = message(i)


def _rows(trace: Trace, name: str) -> Iterator[tuple[int, np.ndarray]]:
    """(first row number, rows) of a table, a block at a time."""
    n = trace.nrows(name, check_codes=False)
    for start in range(0, n, ROW_BLOCK):
        yield start, trace.table(name, rows=slice(start, min(n, start + ROW_BLOCK)), check_codes=False)


def _signs(name: str, rows: np.ndarray, found: _Found) -> None:
    for col in SENTINEL.get(name, ()):
        found.flag(f"{name}.{col}", rows[col] < -1,
                   lambda i, c=col: f"/{name} {c} holds {rows[c][i]} (negative, and only -1 means not recorded)")
    for col in COUNTS.get(name, ()):
        found.flag(f"{name}.{col}", rows[col] < 0, lambda i, c=col: f"/{name} {c} holds {rows[c][i]} (a count, never negative)")


def _step_key(rows: np.ndarray) -> np.ndarray:
    """(manager, step) as one int64: 16 + 32 bits."""
    return (rows["manager"].astype(np.int64) << 32) | rows["step"]


def _group_key(rows: np.ndarray) -> np.ndarray:
    """(manager, step, group) as one int64: 16 + 32 + 8 bits."""
    return (rows["manager"].astype(np.int64) << 40) | (rows["step"].astype(np.int64) << 8) | rows["group"]


def _group_text(k: int) -> str:
    return f"manager {k >> 40}, step {(k >> 8) & 0xFFFFFFFF}, group {k & 0xFF}"


def _isin_sorted(keys: np.ndarray, sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found mask, index into sorted_keys) of each key."""
    if not sorted_keys.size:
        return np.zeros(keys.size, bool), np.zeros(keys.size, np.int64)
    j = np.clip(np.searchsorted(sorted_keys, keys), 0, sorted_keys.size - 1)
    return sorted_keys[j] == keys, j


def serving_problems(trace: Trace, tables: set[str] | None = None, *, codes: bool = True) -> list[str]:
    """Every broken rule of spec §4.15-4.17 and the serving events, one line each (empty: none).
    `tables`: the tables to read (validate passes those of sound structure; default: all present).
    Without /requests the rules that name requests are left out. `codes`: also unknown enumeration
    codes of /sched_groups (validate lists codes of every table itself), so that a reader of any
    serving table refuses a damaged one, not only the reader of /sched_groups."""
    found = _Found()
    tables = {t for t in (*TABLES, "requests") if trace.has(t)} if tables is None else tables
    ids = trace.table("requests", check_codes=False)["request"] if "requests" in tables else None
    none = np.zeros(0, np.int64)
    skeys = _check_sched(trace, found) if "sched" in tables else none
    groups = _check_groups(trace, found, skeys, codes) if "sched_groups" in tables else (none, none, none)
    if "blocks" in tables:
        _check_blocks(trace, found, *groups, ids)
    for _, rows in _rows(trace, "events") if "events" in tables else ():
        _check_events(rows, ids, found)
    return list(found.rules.values())


def _check_sched(trace: Trace, found: _Found) -> np.ndarray:
    """Row rules of /sched; returns every row's (manager, step) key, sorted."""
    n = trace.nrows("sched", check_codes=False)
    key, t = np.empty(n, np.int64), np.empty(n, np.int64)  # filled block by block: no list of copies
    for start, rows in _rows(trace, "sched"):
        _signs("sched", rows, found)
        known = (rows["pool_bytes"] >= 0) & (rows["free_bytes"] >= 0)
        found.flag("sched.free", known & (rows["free_bytes"] > rows["pool_bytes"]),
                   lambda i: "/sched has rows with more free than pool bytes")
        key[start : start + rows.size] = _step_key(rows)
        t[start : start + rows.size] = rows["t_ns"]
    order = np.argsort(key, kind="stable")
    key, t = key[order], t[order]
    repeat = np.concatenate(([False], key[1:] == key[:-1]))
    found.flag("sched.unique", repeat, lambda i: f"/sched repeats step {key[i] & 0xFFFFFFFF} of manager {key[i] >> 32}")
    back = np.concatenate(([False], ((key[1:] >> 32) == (key[:-1] >> 32)) & (t[1:] < t[:-1])))
    found.flag("sched.time", back, lambda i: f"/sched t_ns goes backwards at step {key[i] & 0xFFFFFFFF} of manager "
                                             f"{key[i] >> 32} (a manager's steps are scheduled in time order)")
    return key


def _check_groups(trace: Trace, found: _Found, sched_keys: np.ndarray,
                  codes: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row rules of /sched_groups; returns their (manager, step, group) keys sorted, with blocks_total
    and tokens_per_block in the same order."""
    n = trace.nrows("sched_groups", check_codes=False)
    key, total, per_block = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    for start, rows in _rows(trace, "sched_groups"):
        _signs("sched_groups", rows, found)
        for column, enum_type in schema.ENUM_COLUMNS["sched_groups"] if codes else ():
            unknown = ~np.isin(rows[column], [int(v) for v in enum_type])
            if found.first(f"sched_groups.{column}.code", unknown) is not None:
                found.rules[f"sched_groups.{column}.code"] = (f"/sched_groups {column} has unknown codes "
                                                               f"{np.unique(rows[column][unknown])[:8].tolist()}")
        for col in POSITIVE:
            if (i := found.first(f"sched_groups.{col}", rows[col] < 1)) is not None:
                found.rules[f"sched_groups.{col}"] = f"/sched_groups {col} holds {rows[col][i]} (a block holds at least one)"
        found.flag("sched_groups.window", rows["window"] == 0,
                   lambda i: "/sched_groups window holds 0 (-1 when the group has none, else at least 1)")
        counted = rows["blocks_in_use"] + np.maximum(rows["blocks_cached"], 0) + np.maximum(rows["blocks_free"], 0)
        found.flag("sched_groups.total", (rows["blocks_total"] >= 0) & (counted > rows["blocks_total"]),
                   lambda i: "/sched_groups has rows counting more blocks in use, cached and free than the pool holds")
        if (i := found.first("sched_groups.step", ~_isin_sorted(_step_key(rows), sched_keys)[0])) is not None:
            found.rules["sched_groups.step"] = (f"/sched_groups names a step absent from /sched (manager "
                                                f"{rows['manager'][i]}, step {rows['step'][i]})")
        stop = start + rows.size
        key[start:stop], total[start:stop], per_block[start:stop] = _group_key(rows), rows["blocks_total"], rows["tokens_per_block"]
    order = np.argsort(key, kind="stable")
    key = key[order]
    found.flag("sched_groups.unique", np.concatenate(([False], key[1:] == key[:-1])),
               lambda i: f"/sched_groups repeats {_group_text(int(key[i]))}")
    return key, total[order], per_block[order]


def _check_blocks(trace: Trace, found: _Found, gkeys: np.ndarray, gtotal: np.ndarray, gtpb: np.ndarray,
                  ids: np.ndarray | None) -> None:
    """Row rules of /blocks. A row's (manager, step, group) is replaced by the index of its /sched_groups
    row, so that one int64 (index << 32 | request) per row finds repeated rows: 8 bytes a row, sorted
    in place (a /blocks within the reader's limit holds up to ~10^7 rows per 256 MiB)."""
    n = trace.nrows("blocks", check_codes=False)
    row_key = np.empty(n, np.int64)
    filled = 0
    for _, rows in _rows(trace, "blocks"):
        found.flag("blocks.shared", rows["blocks_shared"] > rows["blocks"],
                   lambda i: "/blocks has rows sharing more blocks than they hold")
        key = _group_key(rows)
        hit, j = _isin_sorted(key, gkeys)
        if (i := found.first("blocks.group", ~hit)) is not None:
            found.rules["blocks.group"] = f"/blocks names a cache group absent from /sched_groups ({_group_text(int(key[i]))})"
        total = gtotal[j] if gtotal.size else np.zeros(key.size, np.int64)
        if (i := found.first("blocks.pool", hit & (total >= 0) & (rows["blocks"] > total))) is not None:
            found.rules["blocks.pool"] = (f"/blocks has rows holding more blocks than their group's pool "
                                          f"({rows['blocks'][i]} of {total[i]} at {_group_text(int(key[i]))})")
        room = rows["blocks"].astype(np.float64) * (gtpb[j] if gtpb.size else 0)  # float: no int64 overflow
        if (i := found.first("blocks.tokens", hit & (rows["tokens_valid"].astype(np.float64) > room))) is not None:
            found.rules["blocks.tokens"] = (f"/blocks has rows holding more tokens than their blocks can "
                                            f"({rows['tokens_valid'][i]} in {rows['blocks'][i]} blocks at "
                                            f"{_group_text(int(key[i]))})")
        orphan = ~np.isin(rows["request"], ids) if ids is not None else np.zeros(rows.size, bool)
        if found.first("blocks.request", orphan) is not None:
            found.rules["blocks.request"] = ("/blocks names requests absent from /requests: "
                                             f"{np.unique(rows['request'][orphan])[:8].tolist()}")
        mine = (j[hit].astype(np.int64) << 32) | rows["request"][hit]  # rows of unknown groups: flagged above
        row_key[filled : filled + mine.size] = mine
        filled += mine.size
    row_key = row_key[:filled]
    row_key.sort()  # in place
    same = row_key[1:] == row_key[:-1]
    if (i := found.first("blocks.unique", same)) is not None:
        k = int(row_key[i])
        found.rules["blocks.unique"] = f"/blocks repeats request {k & 0xFFFFFFFF} at {_group_text(int(gkeys[k >> 32]))}"


def _check_events(rows: np.ndarray, ids: np.ndarray | None, found: _Found) -> None:
    for kind, low in EVENT_MIN.items():
        mine = rows[rows["kind"] == int(kind)]
        if not mine.size:
            continue
        name = kind.name.lower()
        if low is not None:
            found.flag(f"events.{name}", mine["value"] < low,
                       lambda i, m=mine, n=name, lo=low: f"/events {n} holds value {m['value'][i]} (at least {lo})")
        req = mine["request"].astype(np.int64)
        orphan = (req < -1) | ((req >= 0) & ~np.isin(req, ids.astype(np.int64))) if ids is not None else req < -1
        found.flag(f"events.{name}.request", orphan,
                   lambda i, n=name, o=orphan, q=req: f"/events {n} names requests absent from /requests: "
                                                      f"{np.unique(q[o])[:8].tolist()}")
