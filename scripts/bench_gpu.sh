#!/usr/bin/env bash
# Tokens/s and MFU of a ~1B-parameter Llama-style GPT in bf16 with cuDNN fused attention on one
# NVIDIA GPU (goal on one H200: MFU >= 50%). Under 5 minutes. Without a GPU it runs the same
# benchmark at a small size on simulated CPU devices, so CI keeps this script working.
#
#   pip install -e ".[cuda]" && bash scripts/bench_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi -L
  python benchmarks/mfu.py --gpu --model llama-1b --precision bf16 --attention cudnn \
      --batch 8 --seq 2048 --steps 15 --json benchmarks/results/mfu_gpu.json
else
  echo "no NVIDIA GPU found: running the small CPU version"
  python benchmarks/mfu.py --model tiny --batch 8 --seq 64 --steps 3 --json benchmarks/results/mfu_cpu_small.json
fi
