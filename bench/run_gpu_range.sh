#!/usr/bin/env bash
# The GPU tests under both ends of the supported transformers range, on the device machine: the
# image's own release (the floor, 5.17 there) and the newest one carried as a wheel in .whl/
# (installed into /tmp/site, first on PYTHONPATH). Each lane writes a JUnit file and a log.
# Usage: bench/run_gpu_range.sh OUTDIR [SECONDS_PER_LANE]
set -u
out=${1:?output directory}
per_lane=${2:-240}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
GPU_TESTS=(tests/recorder/test_gpu_recorder.py tests/recorder/test_session_gpu.py tests/gpu/test_serving_cuda.py
           tests/gpu/test_telemetry_gpu.py tests/whatif/test_rerun.py)
lane() {  # name pythonpath
    local name=$1 pp=$2
    PYTHONPATH="$pp" timeout "$per_lane" python3 -m pytest -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}" \
        tests/recorder/test_no_host_warnings.py::test_compiled_static_cache_on_cuda_causes_no_warning \
        --junitxml "$out/junit_$name.xml" > "$out/log_$name.txt" 2>&1
    echo "$name: rc=$? $(PYTHONPATH="$pp" python3 -c 'import transformers; print(transformers.__version__)')"
    tail -3 "$out/log_$name.txt"
}
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pipi /tmp/deps .whl/zstandard-*.whl && pipi /tmp/site .whl/transformers-*.whl || { echo "wheel install failed"; exit 1; }
python3 -m pip show pytest-timeout > /dev/null 2>&1 || echo "note: no pytest-timeout"
lane floor "$PWD:/tmp/deps"
lane newest "/tmp/site:$PWD:/tmp/deps"
