"""Loading the model to record: presets (random weights, real KV geometry), local checkpoints and
Hugging Face ids already on disk; never a download.

Used by `kvtrace record` and `kvtrace demo`; a library module (no CLI): bad values raise
kvtrace.errors.BadOption, missing components Unavailable, and the commands map both to exit codes.
torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace.errors import BadOption, Unavailable
from kvtrace.modelspec import preset_name
from kvtrace.units import format_bytes

# What the Hugging Face hub accepts as a repo id ("name" or "org/name"); anything else is a path.
_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


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

def resolve_device(device: str, option: str = "--device") -> str:
    """``device`` with "auto" resolved; a CUDA device on a machine without one is Unavailable
    (exit 69), named by ``option`` (the command's own option name)."""
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"{option} {device}: running a model needs torch ({exc})") from None

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):  # torch's "Expected one of cpu, cuda, ..." (was an internal error)
        raise BadOption(f"{device!r} is not a device (auto, cpu, cuda, cuda:N)", option=option) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise Unavailable(f"{option} {device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise Unavailable(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(dtype: str, device: str, *, preset: bool) -> Any:
    import torch

    if dtype == "auto":
        if not preset:
            return "auto"  # the checkpoint's own dtype
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def model_config_dict(spec: str, *, layers: int | None = None, width: float | None = None,
                      vocab: int | None = None) -> dict[str, Any] | None:
    """The config of ``--model`` as a dict, read without torch (presets, local directories, hub ids
    in the local cache). A model directory that does not exist is a usage error (64) and a hub id
    that is not cached is unavailable (69), both before anything slow happens. None: the config
    could not be read here (the loader decides)."""
    name = preset_name(spec)
    if name is not None:
        from kvtrace import presets

        try:
            return presets.preset_config_dict(name, layers=layers, width_scale=width, vocab=vocab)
        except KeyError as exc:
            raise BadOption(str(exc).strip("'\""), option="--model") from None
        except ValueError as exc:
            raise BadOption(str(exc), option="--layers/--width/--vocab") from None
    if layers is not None or width is not None or vocab is not None:
        raise BadOption("--layers/--width/--vocab/--tiny only apply to preset:NAME models")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BadOption(f"{spec}: the directory holds no config.json (not a Transformers model)",
                                     option="--model")
        return _read_config(path / "config.json")
    if path.exists():
        raise BadOption(f"{spec} is a file, not a model directory", option="--model")
    if not _HF_ID.fullmatch(spec) or ".." in spec:
        raise BadOption(f"{spec}: no such model directory", option="--model")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None  # the loader says what is missing
    cached = try_to_load_from_cache(spec, "config.json")
    if not isinstance(cached, str):  # None or the "known absent" sentinel: never fetched
        raise Unavailable(f"model {spec!r} is not in the Hugging Face cache; kvtrace never downloads: give a local "
                          "directory, an id already in the cache, or preset:NAME (see 'kvtrace presets')")
    return _read_config(Path(cached))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadOption(f"{path} is unreadable ({exc})", option="--model") from None
    if not isinstance(config, dict):
        raise BadOption(f"{path} is not a JSON object", option="--model")
    return config



def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_preset_memory(config: dict[str, Any], dtype_bytes: int, device: str, *, shrunk: bool,
                        name: str, warn: Callable[[str], None] = _to_stderr) -> int:
    """Weight bytes of the preset; warn when it is built at full size, refuse (exit 69) when the
    weights exceed presets.MEMORY_SHARE of the memory available now on ``device``."""
    from kvtrace import presets

    hint = (f"shrink it: --tiny, or --layers N --width F --vocab V (e.g. kvtrace record --model preset:{name} "
            "--tiny ...); KV geometry per layer is kept")
    try:
        need, free, where = presets.check_fits(config, dtype_bytes, device, name=name)
    except presets.PresetTooLarge as exc:
        raise Unavailable(f"{exc}: {hint}") from None
    if not shrunk:
        warn(f"warning: preset {name} at full size: {format_bytes(need)} of random weights "
             f"({format_bytes(free)} {where}); {hint}")
    return need


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment when it launched two or more
    processes, else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    except (KeyError, ValueError):
        return None
    return (rank, world, local) if world > 1 else None


def tp_kwargs(tp_plan: str) -> dict[str, Any]:
    """``tp_plan`` as this transformers' from_pretrained takes it: DistributedConfig(tp_plan=...)
    where that class has the field (5.23: a bare tp_plan= is deprecated), else tp_plan=."""
    import inspect

    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": tp_plan}
    if "tp_plan" in inspect.signature(DistributedConfig).parameters:
        return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}
    return {"tp_plan": tp_plan}


def start_tensor_parallel(device: str) -> str:
    """Join the torchrun group for a tensor-parallel load (gloo on the CPU, nccl on CUDA) and return
    this rank's device (cuda:LOCAL_RANK on CUDA). Outside torchrun: BadOption."""
    import torch
    import torch.distributed as dist

    ranks = torchrun_rank()
    if ranks is None:
        raise BadOption("--tp-plan runs one process per rank under torchrun, e.g. torchrun --nproc-per-node 2 "
                        "-m kvtrace.cli record ... --tp-plan auto", option="--tp-plan")
    rank, _, local = ranks
    if device.startswith("cuda"):
        if torch.cuda.device_count() <= local:
            raise Unavailable(f"--tp-plan: rank {rank} needs cuda:{local}, this machine has "
                              f"{torch.cuda.device_count()} GPU(s)")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return device


def load_model(spec: str, *, device: str, dtype: str, layers: int | None, width: float | None,
               vocab: int | None, seed: int = 0, tp_plan: str | None = None) -> LoadedModel:
    """A model from ``preset:NAME`` (random weights), a local directory, or an HF id already on disk.
    ``tp_plan`` ("auto"): each torchrun rank loads its shard (transformers tensor parallel); a
    preset is built once and loaded by every rank through a temporary checkpoint.

    Never downloads: HF_HUB_OFFLINE is set for this process unless the user set it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise Unavailable(f"recording needs torch and transformers ({exc}); "
                          "install kvtrace[record]") from None
    device = resolve_device(device)
    if tp_plan is not None:
        device = start_tensor_parallel(device)
    name = preset_name(spec)
    if name is not None:
        from kvtrace import presets

        try:
            cfg = presets.preset_config(name, layers=layers, width_scale=width, vocab=vocab)
        except KeyError as exc:
            raise BadOption(str(exc).strip("'\""), option="--model") from None
        except ValueError as exc:
            raise BadOption(str(exc), option="--layers/--width/--vocab") from None
        torch_dtype = resolve_dtype(dtype, device, preset=True)
        check_preset_memory(presets.preset_config_dict(name, layers=layers, width_scale=width, vocab=vocab),
                            torch_dtype.itemsize, device, shrunk=any(v is not None for v in (layers, width, vocab)),
                            name=presets.get_preset(name).name)
        torch.manual_seed(seed)
        auto = transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else transformers.AutoModelForCausalLM
        if tp_plan is not None:
            model = _sharded_preset(auto, cfg, torch_dtype, tp_plan)
        else:
            with torch.device(device):
                model = auto.from_config(cfg, dtype=torch_dtype)
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
        raise BadOption("--layers/--width/--vocab only apply to preset:NAME models")
    try:
        cfg = transformers.AutoConfig.from_pretrained(spec, local_files_only=True)
        auto = transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(spec, local_files_only=True, dtype=resolve_dtype(dtype, device, preset=False),
                                     **(tp_kwargs(tp_plan) if tp_plan is not None else {}))
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unavailable(f"cannot load model {spec!r} from disk ({first}); kvtrace never downloads: "
                          "give a local directory, an id already in the Hugging Face cache, or preset:NAME "
                          "(see 'kvtrace presets')") from None
    if tp_plan is None:  # tensor parallel placed each shard on its rank's device
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



def _sharded_preset(auto: Any, cfg: Any, dtype: Any, tp_plan: str) -> Any:
    """A preset's random weights, built once by rank 0 on the CPU and saved to a temporary
    checkpoint that every rank loads with ``tp_plan`` (transformers shards weights only in
    from_pretrained, and saves only on rank 0). The ranks share one host's file system."""
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    where: list[str | None] = [None]
    try:
        if rank == 0:
            where[0] = tempfile.mkdtemp(prefix="kvtrace-tp-")
            with torch.device("cpu"):
                auto.from_config(cfg, dtype=dtype).save_pretrained(where[0])
        dist.broadcast_object_list(where, src=0)
        model = auto.from_pretrained(where[0], local_files_only=True, dtype=dtype, **tp_kwargs(tp_plan))
        dist.barrier()  # every rank has read the checkpoint before rank 0 removes it
    finally:
        if rank == 0 and where[0]:
            shutil.rmtree(where[0], ignore_errors=True)
    return model


def encode(tok: Any, text: str, device: str) -> Any:
    import torch

    if isinstance(tok, ByteTokenizer):
        ids = tok.encode(text)
    else:
        ids = tok(text, return_tensors=None)["input_ids"]
    return torch.tensor([ids], dtype=torch.long, device=device)


