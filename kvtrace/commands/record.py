"""`kvtrace record`: run generate on a local model or a preset and record its KV cache."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from kvtrace.commands.common import guarded
from kvtrace.commands.metrics_options import check_metrics_options, metrics_options
from kvtrace.errors import TraceIncomplete, Unavailable
from kvtrace.loading import encode, load_model, model_config_dict
from kvtrace.modelspec import preset_name, tiny_shrink
from kvtrace.params import split_list
from kvtrace.units import format_bytes

CACHE_IMPLEMENTATIONS = ("dynamic", "static", "offloaded", "offloaded_static", "quantized_fp8")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_int_list(text: str | None) -> list[int] | None:
    if text is None or text.strip() in ("", "all"):
        return None
    try:
        return [int(x) for x in split_list(text)]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def check_sample_selection(config: dict[str, Any], layers: list[int] | None, heads: list[int] | None) -> None:
    """Sampled layers and heads must exist (kvtrace.geometry.selection_problem, the rule the API
    applies too)."""
    from kvtrace import geometry

    problem = geometry.selection_problem(config, layers, heads)
    if problem is not None:
        raise click.BadParameter(problem[0], param_hint=f"--sample-{problem[1]}")


def read_prompts(prompt: tuple[str, ...], prompts_file: str | None) -> list[str]:
    if bool(prompt) == bool(prompts_file):
        raise click.UsageError("give --prompt TEXT (repeatable) or --prompts FILE, not both or neither")
    if prompt:
        return list(prompt)
    try:
        lines = Path(prompts_file).read_text(encoding="utf-8").splitlines()  # type: ignore[arg-type]
    except OSError as exc:
        raise click.BadParameter(f"cannot read {prompts_file}: {exc.strerror}", param_hint="--prompts") from None
    out = [ln for ln in lines if ln.strip()]
    if not out:
        raise click.BadParameter(f"{prompts_file} holds no prompt (one per line)", param_hint="--prompts")
    return out


def generate_kwargs(max_new_tokens: int, min_new_tokens: int | None, do_sample: bool,
                    temperature: float | None, top_p: float | None, cache_implementation: str) -> dict:
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
    if min_new_tokens is not None:
        kw["min_new_tokens"] = min_new_tokens
    if do_sample:
        if temperature is not None:
            kw["temperature"] = temperature
        if top_p is not None:
            kw["top_p"] = top_p
    if cache_implementation == "quantized_fp8":
        kw["cache_implementation"] = "quantized"
        kw["cache_config"] = {"backend": "fp8"}
    elif cache_implementation != "dynamic":
        kw["cache_implementation"] = cache_implementation
    if cache_implementation in ("static", "offloaded_static"):
        kw["disable_compile"] = True  # compiled forwards would hide the per-step hooks' context
    return kw


@click.command("record")
@click.option("--model", "model_spec", required=True, metavar="PATH|ID|preset:NAME",
              help="Local model directory, HF id already on disk, or preset:NAME (random weights).")
@click.option("--prompt", multiple=True, metavar="TEXT", help="A prompt; repeat for several requests.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Text file, one prompt (request) per line.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), required=True,
              help="Tokens to generate per request at most (generate's max_new_tokens).")
@click.option("--min-new-tokens", type=click.IntRange(min=0), default=None,
              help="Force at least this many tokens (random-weight presets emit EOS at random).")
@click.option("--do-sample/--greedy", default=False, show_default=True,
              help="Sample the next token (with --temperature/--top-p) or pick the most likely one.")
@click.option("--temperature", type=float, default=None,
              help="Sampling temperature; only with --do-sample (default: the model's generation config).")
@click.option("--top-p", type=float, default=None,
              help="Nucleus sampling mass in (0, 1]; only with --do-sample (default: the generation config).")
@click.option("--seed", type=int, default=0, show_default=True, help="torch seed (weights of presets, sampling).")
@click.option("--sample-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Store K/V contents every N steps (0: never; contents are stored only on request).")
@click.option("--sample-layers", default=None, metavar="I,J,...", help="Layers to sample (default all).")
@click.option("--sample-heads", default=None, metavar="H,...", help="KV heads to sample (default all).")
@click.option("--sample-max-tokens", type=click.IntRange(min=1), default=None,
              help="Keep only the last N tokens of each sample.")
@click.option("--sample-queries", is_flag=True, help="Also sample post-RoPE queries.")
@click.option("--sample-tokens", type=click.Choice(["new", "all"]), default="new", show_default=True,
              help="new: each K/V sample holds only tokens no earlier sample holds (joined on analysis); "
                   "all: every kept token at every sample.")
@click.option("--structure-every", type=click.IntRange(min=1), default=8, show_default=True,
              help="Read the per-layer cache structure at prefill, every N-th decode step and the last "
                   "step (1: every step); other steps still get their DECODE_STEP event.")
@click.option("--telemetry-hz", type=click.FloatRange(min=0, min_open=True, max=1000), default=5.0,
              show_default=True, help="Rate of the background sampler (NVML, allocator, process RSS), per second.")
@click.option("--no-nvml", is_flag=True, help="Do not poll NVML.")
@click.option("--store-prompts", is_flag=True, help="Store prompt text in the trace (off by default).")
@click.option("--empty-cache/--no-empty-cache", default=False, show_default=True,
              help="After every request, gc.collect() then torch.cuda.empty_cache(), with a reading after each "
                   "(the full post-EOS measurement, ~0.25 s per request). Off, both run only when KV storage "
                   "outlives its request.")
@click.option("--memory-history", is_flag=True,
              help="Record allocation stacks (torch.cuda.memory._record_memory_history) so the largest unknown "
                   "memory owners are named by their allocation site (/owners; costs throughput, "
                   "docs/benchmarks.md). GPU only.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="auto: the checkpoint's dtype; presets use bfloat16 on CUDA, float32 on CPU.")
@click.option("--cache-implementation", type=click.Choice(CACHE_IMPLEMENTATIONS), default="dynamic",
              show_default=True, help="The transformers cache generate uses (quantized_fp8: the quantized cache with "
              "the fp8 backend).")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Presets: keep the first N layers.")
@click.option("--width", type=click.FloatRange(min=0, min_open=True, max=1), default=None,
              help="Presets: scale hidden/MLP/expert widths (KV geometry kept).")
@click.option("--vocab", type=click.IntRange(min=16), default=None, help="Presets: vocabulary size.")
@click.option("--tiny", is_flag=True,
              help="Presets: shrink to a few layers showing every layer kind, hidden ~256, vocab 512 "
                   "(builds and runs on a CPU in seconds); --layers/--width/--vocab override it.")
@click.option("--tp-plan", "tp_plan", type=click.Choice(["auto"]), default=None,
              help="Tensor parallel: run under torchrun (one process per rank, e.g. torchrun --nproc-per-node 2 "
                   "-m kvtrace.cli record ...); each rank loads its shard with transformers' tp_plan and writes "
                   "its own trace, the rank in the name (run.kvt.h5 -> run.rank0.kvt.h5, or {rank} in -o).")
@click.option("--force", is_flag=True, help="Replace an existing -o file (never one of the inputs).")
@metrics_options
@click.option("--quiet", "-q", is_flag=True, help="Print only errors.")
@click.option("-o", "--output", required=True, type=click.Path(), metavar="TRACE", help="Trace file to write.")
@guarded
def record(model_spec: str, prompt: tuple[str, ...], prompts_file: str | None, max_new_tokens: int,
           min_new_tokens: int | None, do_sample: bool, temperature: float | None, top_p: float | None,
           seed: int, sample_every: int, sample_layers: str | None, sample_heads: str | None,
           sample_max_tokens: int | None, sample_queries: bool, sample_tokens: str, structure_every: int,
           telemetry_hz: float,
           no_nvml: bool,
           store_prompts: bool, empty_cache: bool, memory_history: bool, device: str, dtype: str, cache_implementation: str,
           layers: int | None, width: float | None, vocab: int | None, tiny: bool, tp_plan: str | None, force: bool,
           prometheus: str | None, prometheus_textfile: str | None, prometheus_linger: float, quiet: bool,
           output: str) -> None:
    """Record the KV cache of generate() on a model into a trace file.

    \b
    Examples:
      kvtrace record --model preset:gpt-oss-20b --tiny --prompt "hello" \\
          --max-new-tokens 128 --min-new-tokens 128 -o run.kvt.h5
      kvtrace record --model preset:gpt-oss-20b --layers 4 --width 0.05 --vocab 512 \\
          --prompt "hello" --max-new-tokens 16 -o small.kvt.h5
      kvtrace record --model preset:llama-3.1-8b --tiny --prompt hi --max-new-tokens 8 \\
          --sample-every 4 --sample-heads 0,1 -o sampled.kvt.h5
      kvtrace record --model ./my-llama --prompts prompts.txt --max-new-tokens 64 -o run.kvt.h5
      torchrun --nproc-per-node 2 -m kvtrace.cli record --model ./my-llama --tp-plan auto \\
          --prompt hi --max-new-tokens 16 -o run.kvt.h5      # run.rank0.kvt.h5, run.rank1.kvt.h5
    Nothing is downloaded. Prompt text and tensor contents are stored only when asked.
    Presets build random weights: at full size they warn with the memory needed and are refused
    (exit 69) when it exceeds what is available; --tiny or --layers/--width/--vocab shrink them.
    An existing -o file is refused (exit 64) unless --force.
    Sizes are printed in binary units (KiB = 1024 B).
    """
    prompts = read_prompts(prompt, prompts_file)
    layer_list, head_list = parse_int_list(sample_layers), parse_int_list(sample_heads)
    from kvtrace.commands.outputs import check_output

    rank = _tensor_parallel_rank(tp_plan, prometheus, prometheus_textfile)
    if rank is not None:  # the file this rank writes (the recorder names it the same way)
        output = _rank_output(output, rank)
        quiet = quiet or rank != 0  # one rank speaks; every rank's errors still reach stderr
    check_output(output, option="-o", inputs=[prompts_file] if prompts_file else [], refuse_existing=True,
                 force=force, others=[("--prometheus-textfile", prometheus_textfile)])
    if (layer_list is not None or head_list is not None) and not (sample_every or sample_queries):
        raise click.UsageError("--sample-layers/--sample-heads select what is sampled: add --sample-every N "
                               "(or --sample-queries)")
    if tiny:
        name = preset_name(model_spec)
        if name is None:
            raise click.BadParameter("--tiny only applies to preset:NAME models")
        try:
            layers, width, vocab = tiny_shrink(name, layers, width, vocab)
        except KeyError as exc:
            raise click.BadParameter(str(exc).strip("'\""), param_hint="--model") from None
    config = model_config_dict(model_spec, layers=layers, width=width, vocab=vocab)
    if config is not None:
        check_sample_selection(config, layer_list, head_list)
        if tp_plan is not None:
            _check_tp_split(config)
    check_metrics_options(prometheus, prometheus_textfile, [prompts_file] if prompts_file else [])
    try:
        from kvtrace.recorder.session import check_writable
    except ImportError as exc:
        raise Unavailable(f"recording needs torch and transformers ({exc}); install kvtrace[record]") from None
    check_writable(output)  # before the (possibly slow) model load (CannotWrite: exit 73, guarded)
    from kvtrace.recorder.sampling import SamplingSettings

    try:  # the sampler's own rules (evenly spaced heads...), before the model loads
        SamplingSettings(every_n_steps=sample_every, layers=layer_list, heads=head_list,
                         max_tokens=sample_max_tokens)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sample-layers/--sample-heads") from None

    def say(msg: str) -> None:
        if not quiet:
            click.echo(msg, err=True)

    import torch

    torch.manual_seed(seed)
    loaded = load_model(model_spec, device=device, dtype=dtype, layers=layers, width=width, vocab=vocab,
                        seed=seed, tp_plan=tp_plan)
    say(f"model   {loaded.model_id} ({loaded.model.config.model_type}): {loaded.note}")
    if config is None:  # a hub id: its config is known now, before any generation
        check_sample_selection(loaded.model.config.to_dict(), layer_list, head_list)
    sampling = None
    if sample_every or sample_queries:
        sampling = {"every_n_steps": sample_every, "layers": layer_list, "heads": head_list,
                    "max_tokens": sample_max_tokens, "queries": sample_queries, "tokens": sample_tokens}
    gen_kw = generate_kwargs(max_new_tokens, min_new_tokens, do_sample, temperature, top_p,
                             cache_implementation)
    settings = {"cli": {"command": "record", "model": model_spec, "device": device, "dtype": dtype,
                        "cache_implementation": cache_implementation, "layers": layers, "width": width,
                        "vocab": vocab, "seed": seed, "prompts": len(prompts), "tp_plan": tp_plan, **gen_kw}}
    import kvtrace

    dev = str(next(loaded.model.parameters()).device)
    # a metrics endpoint that cannot be bound is CannotServeMetrics, an Unavailable: exit 69 (guarded)
    rec = kvtrace.record(loaded.model, output, model_id=loaded.model_id, store_prompts=store_prompts,
                         tokenizer=loaded.tokenizer, empty_cache=empty_cache, memory_history=memory_history,
                         telemetry_hz=telemetry_hz, nvml=not no_nvml, sampling=sampling,
                         structure_every=structure_every,
                         prometheus=prometheus, prometheus_textfile=prometheus_textfile,
                         prometheus_linger_s=prometheus_linger,
                         settings_extra=settings)
    with rec:
        if rec.exporter is not None and rec.exporter.url:
            say(f"metrics {rec.exporter.url}")
        for i, text in enumerate(prompts):
            ids = encode(loaded.tokenizer, text, dev)
            out = loaded.model.generate(ids, **gen_kw)
            say(f"request {i}: {ids.shape[-1]} prompt tokens, {out.shape[-1] - ids.shape[-1]} new")
    if rec.storage_failure is not None:  # generation finished; the trace could not be fully written
        raise TraceIncomplete(f"{output}: trace incomplete, writing stopped early "
                              f"({rec.storage_failure.describe()}); it holds everything up to its last flush")
    if rec.recorder_errors:
        say(f"warning: {rec.recorder_errors} recorder error(s) were caught and recorded (RECORDER_ERROR events)")
    if rank is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    if not quiet or rank is not None:  # each rank names its own trace
        print_summary(output)


def _tensor_parallel_rank(tp_plan: str | None, prometheus: str | None, prometheus_textfile: str | None) -> int | None:
    """This process's rank when --tp-plan is given (under torchrun; else exit 64), else None.
    torchrun without --tp-plan is exit 64 too: every process would write the same -o file."""
    from kvtrace.loading import torchrun_rank

    ranks = torchrun_rank()
    if tp_plan is None:
        if ranks is not None:
            raise click.UsageError(f"launched as rank {ranks[0]} of {ranks[1]} (torchrun) without --tp-plan: every "
                                   "process would write the same -o file; pass --tp-plan auto, or run one process")
        return None
    if ranks is None:
        raise click.BadParameter("runs one process per rank under torchrun: torchrun --nproc-per-node N -m "
                                 "kvtrace.cli record ... --tp-plan auto", param_hint="--tp-plan")
    if prometheus or prometheus_textfile:
        raise click.UsageError("--prometheus/--prometheus-textfile with --tp-plan: every rank would serve or write "
                               "the same metrics; record the ranks without them")
    return ranks[0]


def _check_tp_split(config: dict[str, Any]) -> None:
    """Tensor parallel splits every layer's attention heads and KV heads (not an MLA latent) over the
    ranks: a world size that does not divide them is refused before the load (it loaded, then
    generate failed in a reshape on every rank)."""
    from kvtrace import geometry
    from kvtrace.loading import torchrun_rank

    ranks = torchrun_rank()
    if ranks is None:
        return
    try:
        layers = geometry.layer_geometries(config)
    except ValueError:  # a layout the geometry does not model: transformers decides
        return
    world = ranks[1]
    heads = sorted({n for g in layers if g.kind not in ("no_kv", "shared_consumer")
                    for n in ((g.num_attention_heads,) if g.kind == "latent" else (g.num_attention_heads, g.num_kv_heads))
                    if n and n % world})
    if heads:
        raise click.BadParameter(f"{world} ranks do not split the model's heads evenly ({', '.join(map(str, heads))} "
                                 "heads in a layer); use a world size that divides them", param_hint="--tp-plan")


def _rank_output(output: str, rank: int) -> str:
    from kvtrace.recorder.parallel import rank_path

    return rank_path(output, rank)


def print_summary(path: str) -> None:
    from kvtrace.format.reader import Trace

    with Trace(path) as t:
        steps = t.steps[:]
        peak = int(steps["kv_bytes_unique"].max()) if len(steps) else 0
        n_req = t.nrows("requests")
    click.echo(f"trace   {path}: {n_req} request(s), {len(steps)} steps, peak KV cache {format_bytes(peak)} "
               f"(binary units)", err=True)
    sys.stderr.flush()
