"""No warning from transformers is caused by kvtrace: record, whatif --rerun, serve and demo run with
FutureWarning and DeprecationWarning turned into errors, and their output holds no deprecation
notice (transformers prints its renames, such as past_key_values -> cache in 5.24, through its
logger, not through the warnings module, so the output is read too).

A control proves the harness catches what it looks for: reading a generate output's cache by its
old name prints the notice on a transformers that renamed it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers.net import free_port  # noqa: E402
from tests.serving.serve_helpers import (  # noqa: E402
    save_tiny_server_model,
    server_env,
    stop_server,
    wait_healthy,
)

# FutureWarning / DeprecationWarning raised from kvtrace's or transformers' own modules become errors
# (torch's own deprecations, such as torch.jit's inside torch.compile, are not kvtrace's making and
# keep Python's default filters, as the user's process does).
STRICT = ("import warnings\n"
          "for _cat in (FutureWarning, DeprecationWarning):\n"
          "    warnings.filterwarnings('error', category=_cat, module=r'(kvtrace|transformers)(\\.|$)')\n")
CLI = STRICT + "import runpy, sys\nsys.argv[0] = 'kvtrace'\nrunpy.run_module('kvtrace.cli', run_name='__main__')\n"


def _env() -> dict[str, str]:
    return {**server_env(), "TRANSFORMERS_VERBOSITY": "warning", "COLUMNS": "200"}


def _notices(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "deprecat" in line.lower() or "FutureWarning" in line or "DeprecationWarning" in line]


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not _notices(p.stdout + p.stderr), _notices(p.stdout + p.stderr)
    return p


def _kvtrace(*args: str) -> list[str]:
    return [sys.executable, "-c", CLI, *args]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", STRICT + code]


@pytest.mark.slow
def test_the_harness_sees_a_rename_notice(tmp_path):
    """Control: on a transformers whose outputs declare `cache`, the old name prints the notice."""
    code = ("import warnings\nwarnings.simplefilter('ignore')\n"
            "from tests.helpers.models import tiny_model, tiny_prompt\n"
            "m = tiny_model('llama')\nout = m(tiny_prompt(4), use_cache=True)\n"
            "print('has-cache-field', 'cache' in out.keys())\nout.past_key_values\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**server_env(), "TRANSFORMERS_VERBOSITY": "warning"})
    assert p.returncode == 0, p.stderr
    if "has-cache-field True" not in p.stdout:
        pytest.skip(f"transformers {transformers.__version__} has no `cache` output field: nothing renamed")
    assert _notices(p.stdout + p.stderr)


@pytest.mark.slow
def test_record_and_rerun_cause_no_warning(tmp_path):
    _run(_kvtrace("record", "--model", "preset:llama-3.1-8b", "--tiny", "--prompt", "hello", "--prompt", "again",
                  "--max-new-tokens", "6", "--min-new-tokens", "6", "-q", "-o", "r.kvt.h5"), tmp_path)
    from kvtrace import presets

    presets.preset_model("llama-3.1-8b").save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 3)
    _run(_kvtrace("whatif", "--rerun", "model", "--text", "text.txt", "--policy", "knorm", "--policy",
                  "streaming_llm", "--json-out", "w.json"), tmp_path)


@pytest.mark.slow
def test_record_api_on_static_and_dynamic_caches_causes_no_warning(tmp_path):
    code = ("import kvtrace\nfrom tests.helpers.models import tiny_model, tiny_prompt\n"
            "m = tiny_model('gemma3_text')\n"
            "with kvtrace.record(m, 'a.kvt.h5'):\n"
            "    m.generate(tiny_prompt(6), max_new_tokens=4, min_new_tokens=4, do_sample=False)\n"
            "    m.generate(tiny_prompt(6), max_new_tokens=4, min_new_tokens=4, do_sample=False,\n"
            "               cache_implementation='static', disable_compile=True)\n")
    _run(_python(code), tmp_path)


@pytest.mark.slow
def test_demo_causes_no_warning(tmp_path):
    _run(_kvtrace("demo", "-o", "demo"), tmp_path, timeout=900)


@pytest.mark.slow
def test_serve_causes_no_warning(tmp_path):
    pytest.importorskip("fastapi")
    import httpx

    model = save_tiny_server_model(tmp_path / "model")
    port = free_port()
    proc = subprocess.Popen(_kvtrace("serve", str(model), "--port", str(port), "-o", "s.kvt.h5", "--continuous-batching",
                                     "--device", "cpu"), cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        r = httpx.post(f"{url}/v1/completions", json={"model": str(model), "prompt": "the cat", "max_tokens": 4},
                       timeout=120, trust_env=False)
        assert r.status_code == 200, r.text
    finally:
        rc, out = stop_server(proc)
    assert rc == 0, out[-3000:]
    assert not _notices(out), _notices(out)
    assert os.path.getsize(tmp_path / "s.kvt.h5") > 0


@pytest.mark.gpu
def test_compiled_static_cache_on_cuda_causes_no_warning(tmp_path):
    """transformers compiles the forward of a static cache on a GPU: the hooks must not add a
    warning there either (a graph break or recompilation reported by dynamo included)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    code = ("import torch, kvtrace\nfrom tests.helpers.models import tiny_model, tiny_prompt\n"
            "m = tiny_model('llama').to('cuda')\n"
            "with kvtrace.record(m, 'c.kvt.h5'):\n"
            "    for _ in range(2):\n"
            "        m.generate(tiny_prompt(6).to('cuda'), max_new_tokens=8, min_new_tokens=8, do_sample=False,\n"
            "                   cache_implementation='static')\n")
    _run(_python(code), tmp_path)
