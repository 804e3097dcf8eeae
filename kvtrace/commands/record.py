"""`kvtrace record`: run generate on a local model or a preset and record its KV cache."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvtrace.commands.common import CannotWrite, Unavailable, guarded
from kvtrace.units import format_bytes

CACHE_IMPLEMENTATIONS = ("dynamic", "static", "offloaded", "offloaded_static", "quantized_fp8")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ByteTokenizer:
    """For presets (random weights, no tokenizer): token id = UTF-8 byte + 3 (0-2 stay pad/eos/bos)."""

    offset = 3

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 16:
            raise ValueError("vocab too small for byte tokens")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - self.offset
        return [self.offset + (b % span) for b in text.encode("utf-8")] or [self.offset]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        data = bytes((int(i) - self.offset) % 256 for i in ids if int(i) >= self.offset)
        return data.decode("utf-8", errors="replace")


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    model_id: str
    note: str  # what the user should know about how it was built


def parse_int_list(text: str | None) -> list[int] | None:
    if text is None or text.strip() in ("", "all"):
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Unavailable(f"--device {device}: CUDA is not available on this machine")
    return device


def resolve_dtype(dtype: str, device: str, *, preset: bool) -> Any:
    import torch

    if dtype == "auto":
        if not preset:
            return "auto"  # the checkpoint's own dtype
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def load_model(spec: str, *, device: str, dtype: str, layers: int | None, width: float | None,
               vocab: int | None, seed: int = 0) -> LoadedModel:
    """A model from ``preset:NAME`` (random weights), a local directory, or an HF id already on disk.

    Never downloads: HF_HUB_OFFLINE is set for this process unless the user set it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise Unavailable(f"recording needs torch and transformers ({exc}); "
                          "install kvtrace[record]") from None
    device = resolve_device(device)
    if spec.startswith("preset:"):
        from kvtrace import presets

        name = spec.split(":", 1)[1]
        try:
            cfg = presets.preset_config(name, layers=layers, width_scale=width, vocab=vocab)
        except KeyError as exc:
            raise click.BadParameter(str(exc).strip("'\""), param_hint="--model") from None
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--layers/--width/--vocab") from None
        torch.manual_seed(seed)
        auto = transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else transformers.AutoModelForCausalLM
        with torch.device(device):
            model = auto.from_config(cfg, dtype=resolve_dtype(dtype, device, preset=True))
        model.eval()
        gen = model.generation_config
        if gen.pad_token_id is None:
            eos = gen.eos_token_id
            gen.pad_token_id = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        tok = ByteTokenizer(int(cfg.vocab_size))
        shrink = [f"{k}={v}" for k, v in (("layers", layers), ("width", width), ("vocab", vocab)) if v]
        note = (f"preset {presets.get_preset(name).name}: random weights, real KV geometry"
                + (f" (shrunk: {', '.join(shrink)})" if shrink else "")
                + "; prompts tokenized as UTF-8 bytes")
        return LoadedModel(model, tok, f"preset:{presets.get_preset(name).name}", note)
    if layers is not None or width is not None or vocab is not None:
        raise click.BadParameter("--layers/--width/--vocab only apply to preset:NAME models")
    try:
        cfg = transformers.AutoConfig.from_pretrained(spec, local_files_only=True)
        auto = transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(spec, local_files_only=True, dtype=resolve_dtype(dtype, device, preset=False))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unavailable(f"cannot load model {spec!r} from disk ({first}); kvtrace never downloads: "
                          "give a local directory, an id already in the Hugging Face cache, or preset:NAME "
                          "(see 'kvtrace presets')") from None
    model.to(device)
    model.eval()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(spec, local_files_only=True)
        note = "tokenizer from the checkpoint"
    except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer still records
        tok = ByteTokenizer(int(cfg.get_text_config().vocab_size))
        note = "no tokenizer found: prompts tokenized as UTF-8 bytes"
    if model.generation_config.pad_token_id is None and getattr(tok, "pad_token_id", None) is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return LoadedModel(model, tok, spec, note)


def check_bindable(host: str, port: int) -> None:
    """Bind and release ``host:port`` the way the metrics server will, so a busy port or a bad
    host fails before the model loads (the server binds again when recording starts)."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            s.bind((host, port))
    except OSError as exc:
        raise Unavailable(f"cannot serve Prometheus metrics on {host}:{port}: {exc.strerror or exc}") from None


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


def encode(tok: Any, text: str, device: str) -> Any:
    import torch

    if isinstance(tok, ByteTokenizer):
        ids = tok.encode(text)
    else:
        ids = tok(text, return_tensors=None)["input_ids"]
    return torch.tensor([ids], dtype=torch.long, device=device)


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
@click.option("--max-new-tokens", type=click.IntRange(min=1), required=True)
@click.option("--min-new-tokens", type=click.IntRange(min=0), default=None,
              help="Force at least this many tokens (random-weight presets emit EOS at random).")
@click.option("--do-sample/--greedy", default=False, show_default=True)
@click.option("--temperature", type=float, default=None)
@click.option("--top-p", type=float, default=None)
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
@click.option("--telemetry-hz", type=click.FloatRange(min=0, min_open=True, max=1000), default=20.0,
              show_default=True)
@click.option("--no-nvml", is_flag=True, help="Do not poll NVML.")
@click.option("--store-prompts", is_flag=True, help="Store prompt text in the trace (off by default).")
@click.option("--no-empty-cache", is_flag=True, help="Skip torch.cuda.empty_cache() after each request.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="auto: the checkpoint's dtype; presets use bfloat16 on CUDA, float32 on CPU.")
@click.option("--cache-implementation", type=click.Choice(CACHE_IMPLEMENTATIONS), default="dynamic",
              show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Presets: keep the first N layers.")
@click.option("--width", type=click.FloatRange(min=0, min_open=True, max=1), default=None,
              help="Presets: scale hidden/MLP/expert widths (KV geometry kept).")
@click.option("--vocab", type=click.IntRange(min=16), default=None, help="Presets: vocabulary size.")
@click.option("--prometheus", "prometheus", default=None, metavar="HOST:PORT",
              help="Serve live metrics at http://HOST:PORT/metrics while recording (bind 127.0.0.1 "
                   "unless the scraper is on another host).")
@click.option("--prometheus-textfile", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the metrics to FILE for node_exporter's textfile collector "
                   "(atomic rewrite, at most once a second, at each request end and at exit).")
@click.option("--quiet", "-q", is_flag=True, help="Print only errors.")
@click.option("-o", "--output", required=True, type=click.Path(), metavar="TRACE", help="Trace file to write.")
@guarded
def record(model_spec: str, prompt: tuple[str, ...], prompts_file: str | None, max_new_tokens: int,
           min_new_tokens: int | None, do_sample: bool, temperature: float | None, top_p: float | None,
           seed: int, sample_every: int, sample_layers: str | None, sample_heads: str | None,
           sample_max_tokens: int | None, sample_queries: bool, sample_tokens: str, structure_every: int,
           telemetry_hz: float,
           no_nvml: bool,
           store_prompts: bool, no_empty_cache: bool, device: str, dtype: str, cache_implementation: str,
           layers: int | None, width: float | None, vocab: int | None, prometheus: str | None,
           prometheus_textfile: str | None, quiet: bool, output: str) -> None:
    """Record the KV cache of generate() on a model into a trace file.

    \b
    Examples:
      kvtrace record --model preset:gpt-oss-20b --layers 4 --width 0.1 --vocab 512 \\
          --prompt "hello" --max-new-tokens 256 --min-new-tokens 256 -o run.kvt.h5
      kvtrace record --model ./my-llama --prompts prompts.txt --max-new-tokens 512 -o run.kvt.h5
    Nothing is downloaded. Prompt text and tensor contents are stored only when asked.
    Sizes are printed in binary units (KiB = 1024 B).
    """
    prompts = read_prompts(prompt, prompts_file)
    layer_list, head_list = parse_int_list(sample_layers), parse_int_list(sample_heads)
    if prometheus is not None:
        from kvtrace.export.prometheus import parse_address

        try:
            host, port = parse_address(prometheus)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--prometheus") from None
        check_bindable(host, port)  # before the (possibly slow) model load
    try:
        from kvtrace.recorder.session import (
            CannotServeMetrics,
            CannotWriteOutput,
            check_textfile,
            check_writable,
        )
    except ImportError as exc:
        raise Unavailable(f"recording needs torch and transformers ({exc}); install kvtrace[record]") from None
    try:
        check_writable(output)  # before the (possibly slow) model load
        if prometheus_textfile is not None:
            check_textfile(prometheus_textfile)
    except CannotWriteOutput as exc:
        raise CannotWrite(str(exc)) from None

    def say(msg: str) -> None:
        if not quiet:
            click.echo(msg, err=True)

    import torch

    torch.manual_seed(seed)
    loaded = load_model(model_spec, device=device, dtype=dtype, layers=layers, width=width, vocab=vocab,
                        seed=seed)
    say(f"model   {loaded.model_id} ({loaded.model.config.model_type}): {loaded.note}")
    sampling = None
    if sample_every or sample_queries:
        sampling = {"every_n_steps": sample_every, "layers": layer_list, "heads": head_list,
                    "max_tokens": sample_max_tokens, "queries": sample_queries, "tokens": sample_tokens}
    gen_kw = generate_kwargs(max_new_tokens, min_new_tokens, do_sample, temperature, top_p,
                             cache_implementation)
    settings = {"cli": {"command": "record", "model": model_spec, "device": device, "dtype": dtype,
                        "cache_implementation": cache_implementation, "layers": layers, "width": width,
                        "vocab": vocab, "seed": seed, "prompts": len(prompts), **gen_kw}}
    import kvtrace

    dev = str(next(loaded.model.parameters()).device)
    try:
        rec = kvtrace.record(loaded.model, output, model_id=loaded.model_id, store_prompts=store_prompts,
                             tokenizer=loaded.tokenizer, empty_cache=not no_empty_cache,
                             telemetry_hz=telemetry_hz, nvml=not no_nvml, sampling=sampling,
                             structure_every=structure_every,
                             prometheus=prometheus, prometheus_textfile=prometheus_textfile,
                             settings_extra=settings)
        with rec:
            if rec.exporter is not None and rec.exporter.url:
                say(f"metrics {rec.exporter.url}")
            for i, text in enumerate(prompts):
                ids = encode(loaded.tokenizer, text, dev)
                out = loaded.model.generate(ids, **gen_kw)
                say(f"request {i}: {ids.shape[-1]} prompt tokens, {out.shape[-1] - ids.shape[-1]} new")
    except CannotWriteOutput as exc:
        raise CannotWrite(str(exc)) from None
    except CannotServeMetrics as exc:
        raise Unavailable(str(exc)) from None
    if rec.recorder_errors:
        say(f"warning: {rec.recorder_errors} recorder error(s) were caught and recorded (RECORDER_ERROR events)")
    if not quiet:
        print_summary(output)


def print_summary(path: str) -> None:
    from kvtrace.format.reader import Trace

    with Trace(path) as t:
        steps = t.steps()
        peak = int(steps["kv_bytes_unique"].max()) if len(steps) else 0
        n_req = t.nrows("requests")
    click.echo(f"trace   {path}: {n_req} request(s), {len(steps)} steps, peak KV cache {format_bytes(peak)} "
               f"(binary units)", err=True)
    sys.stderr.flush()
