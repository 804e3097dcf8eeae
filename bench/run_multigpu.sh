#!/usr/bin/env bash
# The two-GPU runs (nvidia-h200-x2 or any host with 2+ GPUs): device_map across two
# GPUs and tensor parallel over NCCL under torchrun, recorded and analysed as one run.
# Usage: bench/run_multigpu.sh OUTDIR   (kvtrace importable, zstandard installed)
set -u
out=${1:?output directory}
mkdir -p "$out/tp"
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
echo "== pytest tests/gpu/test_parallel_gpu.py (device_map cuda:0+cpu, cuda:0+cuda:1, tensor parallel nccl)"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu/test_parallel_gpu.py 2>&1 | tail -25
echo "== tensor parallel, nccl, 2 ranks, recorded by kvtrace (tests/parallel/tp_record.py)"
timeout 180 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/parallel/tp_record.py \
    --out "$out/tp" --backend nccl --requests 2 --tokens 16 2>&1 | tail -15
ls -la "$out/tp"
echo "== kvtrace analyze / info / calc over the rank traces"
python3 -m kvtrace.cli analyze "$out"/tp/*.rank*.kvt.h5 --json-out "$out/tp_analyze.json"; echo "analyze rc=$?"
python3 -m kvtrace.cli analyze "$out"/tp/*.rank*.kvt.h5 2>&1 | tail -30
python3 -m kvtrace.cli info "$out"/tp/*.rank*.kvt.h5 2>&1 | tail -20
python3 -m kvtrace.cli calc $(for f in "$out"/tp/*.rank*.kvt.h5; do echo --trace "$f"; done) --context 4k \
    --gpu-memory 141GB 2>&1 | tail -20
