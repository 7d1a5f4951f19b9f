#!/usr/bin/env bash
# On a CUDA machine with internet access to PyPI: vLLM's CUDA build, the engine tests on the
# GPU, then the engine benchmark at both model sizes and completion lengths, the step profiles
# (demo and 106M) and the prefix-cache comparison; it writes
# benchmarks/results/rollout.md (then run python benchmarks/collect_results.py).
#   bash benchmarks/gpu_rollout.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -e ".[dev,vllm]"
python -m pytest -q -m vllm tests/loop/test_vllm_engine.py
python benchmarks/bench_rollout.py --models tiny,100m --new-tokens 64,256 --repeats 3 --steps 5
python benchmarks/bench_rollout.py --profile --steps 8
python benchmarks/bench_rollout.py --profile --profile-model 100m --engines hf,vllm --steps 5
python benchmarks/bench_rollout.py --part prefix --models 100m
