"""`kvtrace calc`: capacity planning from a preset, a config.json or a recorded trace."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import click

from kvtrace import modelspec
from kvtrace.calc import KV_DTYPE_BYTES as KV_DTYPES
from kvtrace.calc import WEIGHT_DTYPE_BYTES as WEIGHT_DTYPES
from kvtrace.commands.common import guarded
from kvtrace.commands.outputs import check_json_out, json_options, write_json

if TYPE_CHECKING:  # `kvtrace calc` without --trace loads no reader
    from kvtrace.analyzer.report import AnalysisReport
    from kvtrace.format.reader import Trace

MAX_TOKENS = (1 << 63) - 1
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'80GiB' / '80G' / '80 GiB' -> binary units; '141GB' -> decimal (1e9); '1024' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 80GiB, 141GB, 85899345920)")
    value, unit = float(m.group(1)), (m.group(2) or "B")
    u = unit.upper()
    if u == "B":
        return int(value)
    power = "KMGT".index(u[0]) + 1
    decimal = u.endswith("B") and not u.endswith("IB")  # "GB": 10^9; "G", "GiB": 2^30
    return int(value * (1000**power if decimal else 1024**power))


def parse_tokens(text: str) -> int:
    """'131072', '128k' or '128Ki' (both 128 x 1024: context lengths are counted in powers of two)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*(k|ki|K|Ki|KI)?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a token count (e.g. 8192 or 128k)")
    tokens = int(m.group(1)) * (1024 if m.group(2) else 1)
    if tokens > MAX_TOKENS:  # the planner counts in int64
        raise ValueError(f"{text!r} is more tokens than can be planned (at most {MAX_TOKENS})")
    return tokens


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class _Tokens(click.ParamType):
    name = "TOKENS"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_tokens(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.command("calc")
@click.option("--preset", default=None, help="A built-in model preset (see 'kvtrace presets').")
@click.option("--config", "config_path", type=click.Path(exists=False), default=None,
              help="A Hugging Face config.json (or a directory holding one).")
@click.option("--trace", "trace_paths", type=click.Path(), multiple=True,  # a directory: not a trace (2)
              help="A recorded trace: its model config, cache dtype, and a check of measured vs predicted KV. "
                   "Repeat it with every rank trace of a tensor-parallel run to check --tp against each rank.")
@click.option("--context", "context", type=_Tokens(), required=True, help="Tokens per request (8192, 128k).")
@click.option("--gpu-memory", "gpu_memory", type=_Size(), required=True,
              help="Memory of one GPU: 80GiB, 80G (binary), 141GB (decimal), or bytes.")
@click.option("--tp", default=None, type=click.IntRange(min=1),
              help="Tensor-parallel degree [default: 1, or the world size of the rank traces given].")
@click.option("--kv-dtype", type=click.Choice(sorted(KV_DTYPES)), default=None,
              help="Cache element type [default: bf16, or the trace's].")
@click.option("--weight-dtype", type=click.Choice(sorted(WEIGHT_DTYPES)), default=None,
              help="One dtype for every weight [default: the checkpoint's own: a preset's (gpt-oss: MXFP4 "
                   "experts, bf16 rest; deepseek-v3: fp8), or the config's quantization_config / dtype].")
@click.option("--batch", default=None, type=click.IntRange(min=1), help="Concurrent requests to check [default: 1].")
@click.option("--reserve", default=0.1, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Fraction of each GPU set aside for the CUDA context, allocator slack and activations.")
@click.option("--cache", "cache_kind", type=click.Choice(["dynamic", "static"]), default="dynamic", show_default=True,
              help="dynamic: bytes grow with the tokens held; static: preallocated to --context.")
@click.option("--encoder-len", type=click.IntRange(min=1), default=None,
              help="Encoder tokens held by cross-attention layers (encoder-decoder models).")
@click.option("--mla-cache", type=click.Choice(["latent", "expanded"]), default="latent", show_default=True,
              help="How MLA layers are cached (transformers 5.x: latent).")
@click.option("--engine", type=click.Choice(["vllm"]), default=None,
              help="Predict a serving engine's KV pool instead: vLLM's 'KV cache size' line, with --gpu-memory the "
                   "KV budget (--kv-cache-memory-bytes) and --context the max model length; with an engine --trace "
                   "(kvtrace attach) checked against the engine's cache_config_info.")
@json_options
@click.option("--quiet", "-q", is_flag=True, help="Print only FITS / DOES NOT FIT.")
@guarded
def calc(preset: str | None, config_path: str | None, trace_paths: tuple[str, ...], context: int, gpu_memory: int,
         tp: int | None, kv_dtype: str | None, weight_dtype: str | None, batch: int | None, reserve: float, cache_kind: str,
         encoder_len: int | None, mla_cache: str, engine: str | None, as_json: bool, json_out: str | None,
         quiet: bool) -> None:
    """Plan capacity: exact KV bytes per token and per request (windows, MLA latents, KV
    sharing, fp8 KV), weight bytes, and for a context length, GPU memory and tensor-parallel
    degree: does it fit, the headroom, and the largest number of concurrent requests.

    Give exactly one of --preset, --config, --trace. Sizes print in binary units (GiB = 2^30 B).
    Exit code 0 whether or not it fits; read FITS / DOES NOT FIT (or "fits" in --json).

    \b
    Examples:
      kvtrace calc --preset gpt-oss-120b --context 128k --gpu-memory 80GiB
      kvtrace calc --config ./llama/config.json --context 8192 --gpu-memory 80GiB --tp 4 --kv-dtype fp8
      kvtrace calc --trace run.kvt.h5 --context 32k --gpu-memory 141GB --json
      kvtrace calc --engine vllm --trace engine.kvt.h5 --context 512 --gpu-memory 1MiB
    """
    if engine is not None:  # an engine's pool (kvtrace/commands/calc_engine.py)
        from kvtrace.commands.calc_engine import run as run_engine

        run_engine(preset, config_path, trace_paths, context, gpu_memory, kv_dtype, as_json, json_out)
        return
    from kvtrace import calc as planner

    trace_path = trace_paths[0] if trace_paths else None
    sources = [s for s in (preset, config_path, trace_path) if s is not None]
    if len(sources) != 1:
        raise click.UsageError("give exactly one of --preset, --config, --trace")
    check_json_out(json_out, [s for s in (config_path, *trace_paths) if s is not None])
    check = None
    # each trace is opened once: the first one's calc --trace reading comes from the same trace
    ranks, first = _rank_traces(trace_paths)  # ranks: None unless the traces are tensor-parallel ranks
    if tp is None:
        tp = ranks.world_size or len(ranks.members) if ranks is not None else 1
    preset_name = preset
    if trace_path is not None:
        config, label, trace_kv_bytes, check = first
        kv_bytes = KV_DTYPES[kv_dtype] if kv_dtype else trace_kv_bytes
        if (recorded := modelspec.preset_name(label)) is not None:  # random weights; plan for the checkpoint
            preset_name = recorded
    else:
        kv_bytes = KV_DTYPES[kv_dtype or "bf16"]
        source = preset if preset is not None else config_path
        try:
            config, label = planner.load_config(source)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--preset" if preset else "--config") from None
    if label and isinstance(config, dict):
        config = {**config, "_name_or_path": label}
    try:
        dtypes = ({"default": weight_dtype} if weight_dtype else
                  planner.checkpoint_weight_dtypes(config, _known_preset(preset_name)))
        plan = planner.plan_capacity(
            config, context_len=context, gpu_memory_bytes=gpu_memory, tp=tp, kv_dtype_bytes=kv_bytes,
            weight_dtypes=dtypes, batch=batch, reserve_fraction=reserve,
            cache_kind=cache_kind, encoder_len=encoder_len, mla_cache=mla_cache)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.UsageError(f"cannot plan this model: {exc}") from None
    doc = plan.to_dict()
    if check is not None:
        doc["trace_check"] = check
    if ranks is not None:
        doc["rank_check"] = _rank_check(ranks, plan)
    write_json(doc, json_out, as_json=as_json)
    if as_json:
        return
    if quiet:
        click.echo("FITS" if plan.fits else "DOES NOT FIT")
    else:
        from kvtrace.textsafe import visible_lines  # model ids and paths from traces and configs: data

        click.echo(visible_lines(planner.format_plan(plan)))
        if check is not None:
            click.echo(visible_lines(_format_check(check)))
        if ranks is not None:
            click.echo(visible_lines(_format_rank_check(doc["rank_check"])))


def _known_preset(name: str | None) -> str | None:
    from kvtrace import presets

    try:
        return None if name is None else presets.get_preset(name).name
    except KeyError:
        return None


def render(trace: Trace, report: AnalysisReport | None) -> tuple[dict[str, Any], str, int, dict[str, Any]]:
    """The ``calc --trace`` renderer: the model config, label and cache element size a trace's
    trace holds, and its last step's recorded KV bytes against kvtrace.geometry's prediction.
    ``report`` is taken for the renderers' common shape and not read: the check compares the
    recording with the geometry, not with the analyser's findings. Raises click.UsageError
    for a trace without a model config."""
    from kvtrace.format import schema
    from kvtrace.report.kvcheck import check_kv

    del report  # see the docstring
    from kvtrace.geometry.bounds import checked_config

    config = checked_config(trace, trace.layers[:])  # sizes within bounds before they size anything (exit 1)
    if not config:
        raise click.UsageError(f"{trace.path}: the trace stores no model config; use --preset or --config")
    first = trace.kv[:1]
    itemsize = 2
    if first.size:
        try:
            itemsize = schema.DTYPE_ITEMSIZE[schema.CacheDType(int(first[0]["k_dtype"]))]
        except (ValueError, KeyError):
            pass
    kc = check_kv(trace, "last")
    last = kc.steps[-1] if kc.steps else None
    check = {
        "note": kc.note,
        "request": None if last is None else last.request,
        "step": None if last is None else last.step,
        "tokens_seen": None if last is None else last.tokens_seen,
        "measured_bytes": None if last is None else last.measured,
        "predicted_bytes": None if last is None else last.predicted,
        "equal": None if last is None else last.equal,
        "mismatched_layers": [] if last is None else [
            {"layer": a, "measured_bytes": b, "predicted_bytes": c} for a, b, c in last.mismatches[:32]],
    }
    state = _state_check(trace, config, check["request"], check["step"], itemsize)
    if state is not None:  # hybrid models only: attention-only documents keep their keys
        check["state"] = state
    return dict(config), trace.meta.model_id, itemsize, check


def _state_check(trace: Trace, config: dict[str, Any], request: int | None, step: int | None,
                 itemsize: int) -> dict[str, Any] | None:
    """A hybrid trace's recorded state (format 1.5 /state) at the checked step against
    kvtrace.geometry.hybrid's prediction (batch x per-sequence bytes, layer by layer); None when the
    trace holds no state."""
    from kvtrace.format import schema
    from kvtrace.geometry.hybrid import state_geometry

    rows = trace.state_rows
    if not rows.size:
        return None
    if request is None or step is None:  # no KV step checked (a pure-SSM model): the last state step
        request, step = max(trace.state_steps)
    at = rows[(rows["request"] == request) & (rows["step"] == step)]
    measured: dict[int, int] = {}
    for layer, nbytes in zip(at["layer"].tolist(), at["bytes_valid"].tolist(), strict=True):
        measured[int(layer)] = measured.get(int(layer), 0) + int(nbytes)
    model_dtype = at[at["kind"] != int(schema.StateKind.RECURRENT)]["dtype"]
    size = schema.DTYPE_ITEMSIZE.get(schema.CacheDType(int(model_dtype[0])), itemsize) if model_dtype.size else itemsize
    req = trace.requests[:][trace.requests[:]["request"] == request]
    batch = int(req["batch_size"][0]) if req.size and int(req["batch_size"][0]) > 0 else 1
    out: dict[str, Any] = {"request": int(request), "step": int(step), "batch_size": batch,
                           "measured_bytes": sum(measured.values()), "predicted_bytes": None, "equal": None,
                           "mismatched_layers": [], "note": ""}
    try:
        sg = state_geometry(config)
    except ValueError as exc:
        out["note"] = str(exc)
        return out
    predicted = {k: v * batch for k, v in (sg.per_layer(size) if sg is not None else {}).items()}
    out["predicted_bytes"] = sum(predicted.values())
    out["equal"] = measured == predicted
    out["mismatched_layers"] = [{"layer": k, "measured_bytes": measured.get(k, 0), "predicted_bytes": predicted.get(k, 0)}
                                for k in sorted(set(measured) | set(predicted))
                                if measured.get(k, 0) != predicted.get(k, 0)][:32]
    return out


def _format_check(check: dict[str, Any]) -> str:
    state = _format_state_check(check["state"]) if "state" in check else ""
    return _format_kv_check(check) + state


def _format_state_check(st: dict[str, Any]) -> str:
    from kvtrace.units import format_bytes

    head = (f"\n  state check: request {st['request']} step {st['step']} (batch {st['batch_size']}): recorded "
            f"{format_bytes(st['measured_bytes'])} ({st['measured_bytes']} B)")
    if st["equal"] is None:
        return head + f", not predicted ({st['note']})"
    head += f", predicted {format_bytes(st['predicted_bytes'])} ({st['predicted_bytes']} B): "
    if st["equal"]:
        return head + "equal"
    layers = ", ".join(f"layer {m['layer']} {m['measured_bytes']} vs {m['predicted_bytes']} B"
                       for m in st["mismatched_layers"][:6])
    return head + f"DIFFERENT ({layers})"


def _format_kv_check(check: dict[str, Any]) -> str:
    from kvtrace.units import format_bytes

    if check["equal"] is None:
        return f"  trace check: not possible ({check['note']})"
    head = (f"  trace check: request {check['request']} step {check['step']} ({check['tokens_seen']} tokens): "
            f"recorded {format_bytes(check['measured_bytes'])} ({check['measured_bytes']} B), "
            f"predicted {format_bytes(check['predicted_bytes'])} ({check['predicted_bytes']} B): ")
    if check["equal"]:
        return head + "equal"
    layers = ", ".join(f"layer {m['layer']} {m['measured_bytes']} vs {m['predicted_bytes']} B"
                       for m in check["mismatched_layers"][:6])
    return head + f"DIFFERENT ({layers})"


def _rank_traces(paths: tuple[str, ...]) -> tuple[Any, Any]:
    """(the RankSet of the --trace files when they are ranks of one tensor-parallel run, else None;
    the ``render`` of the first trace, else None). Several traces that are not the ranks of one run:
    a usage error. Each trace is opened once."""
    from kvtrace.analyzer.ranks import group, rank_trace
    from kvtrace.format.reader import Trace

    members = []
    first = None
    for i, path in enumerate(paths):
        with Trace(path) as t:
            member = rank_trace(t)
            if i == 0:
                first = render(t, None)
        if member is None and len(paths) > 1:
            raise click.UsageError(f"{path} is not a tensor-parallel rank trace: several --trace must be the rank "
                                   "traces of one run")
        if member is not None:
            members.append(member)
    if not members:
        return None, first
    sets = group(members)
    if len(sets) > 1:
        raise click.UsageError(f"the --trace files belong to {len(sets)} runs ({', '.join(s.run_id for s in sets)}); "
                               "give the ranks of one run")
    from kvtrace.analyzer.rankset import refuse_claimed_twice

    refuse_claimed_twice(sets)  # two files claiming one rank: exit 1 naming it and the ranks missing
    if sets[0].problems:  # a rank given twice, world sizes that disagree, a rank outside the world
        raise click.UsageError(f"the --trace files are not the ranks of one run: {'; '.join(sets[0].problems)}")
    return sets[0], first


def _rank_check(rs: Any, plan: Any) -> dict[str, Any]:
    """--tp against the rank traces: KV heads per layer each rank holds, and each rank's KV bytes at
    its last request's last step against the plan's share of the model's bytes at those tokens."""
    planned_heads = max(plan.kv_heads_per_rank.values(), default=0)
    share = plan.kv_bytes_per_request / plan.kv_bytes_per_request_total if plan.kv_bytes_per_request_total else 0.0
    rows = []
    for m in rs.members:
        rid = max(m.requests) if m.requests else None
        model = rs.model_kv_bytes(rid) if rid is not None else None
        measured = m.requests[rid][3] if rid is not None else None
        predicted = int(round(model * share)) if model is not None else None
        rows.append({"rank": m.rank, "path": m.path, "request": rid, "kv_heads_recorded": m.kv_heads_recorded,
                     "kv_heads_planned": planned_heads, "measured_bytes": measured, "predicted_bytes": predicted,
                     "equal": (measured == predicted and m.kv_heads_recorded == planned_heads)
                     if predicted is not None else None})
    return {"tp": plan.tp, "world_size": rs.world_size, "run_id": rs.run_id, "missing_ranks": rs.missing,
            "ranks": rows, "agrees": bool(rows) and plan.tp == rs.world_size and not rs.missing
            and all(r["equal"] for r in rows)}


def _format_rank_check(rc: dict[str, Any]) -> str:
    from kvtrace.analyzer.ranks import ranks_text
    from kvtrace.units import format_bytes

    lines = [f"  rank check: --tp {rc['tp']} against run {rc['run_id']} (world size {rc['world_size']}): "
             + ("agrees" if rc["agrees"] else "DIFFERS")]
    if rc["missing_ranks"]:
        lines.append(f"    rank trace(s) {ranks_text(rc['missing_ranks'])} not given")
    for r in rc["ranks"]:
        got = format_bytes(r["measured_bytes"]) if r["measured_bytes"] is not None else "?"
        want = format_bytes(r["predicted_bytes"]) if r["predicted_bytes"] is not None else "?"
        lines.append(f"    rank {r['rank']}: {r['kv_heads_recorded']} KV heads/layer (plan {r['kv_heads_planned']}), "
                     f"KV {got} (plan {want}) at request {r['request']}: "
                     + {True: "equal", False: "DIFFERENT", None: "not checked"}[r["equal"]])
    return "\n".join(lines)
