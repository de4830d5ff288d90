#!/usr/bin/env bash
# The GPU checks, as one command on a GPU machine (see CONTRIBUTING.md, "GPU checks"):
#   1. tests/test_cuda.py (skipped on CPU-only machines, i.e. in CI),
#   2. benchmarks/gpu/gpu_bench.py: seqcal vs llm-compressor GPTQ on a SmolLM2-shaped model,
#   3. the tests that run on the execution device, with CUDA visible (offloaded weights then run on the GPU).
# The machine may have no network: wheels are read from .whl/ (common, seqcal, peer) and the SmolLM2 config and
# tokenizer in .gpu/tok/; prepare them with benchmarks/gpu/gpu_prepare.sh and carry both folders.
# Logs and results go to $OUT (default /tmp/seqcal-gpu-out); each stage has its own time limit.
set -u
OUT=${OUT:-/tmp/seqcal-gpu-out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers, pyarrow; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers(system)', transformers.__version__, 'pyarrow', pyarrow.__version__)"
} 2>&1 | tee "$OUT/env.txt"

INSTALL_LOG="$OUT/install.log"
# shellcheck source=benchmarks/gpu/_gpu_install.sh
source benchmarks/gpu/_gpu_install.sh  # the prepared wheels, once per machine; sets SEQ

echo "== tests/test_cuda.py"
PYTHONPATH=$SEQ timeout ${CUDA_TEST_SECONDS:-90} $PY -m pytest -q -o addopts="" -p no:cacheprovider tests/test_cuda.py 2>&1 \
  | tee "$OUT/test_cuda.log" | tail -15

echo "== benchmark"
PYTHONPATH=$SEQ timeout ${BENCH_SECONDS:-260} $PY benchmarks/gpu/gpu_bench.py --config-dir .gpu/tok --out "$OUT/gpu_bench.json" \
  --seqcal-path "$SEQ" --peer-path /tmp/peer-site --peer-python "${PEER_PY:-$PY}" --timeout 90 --runs seqcal,llmc,seqcal-bs8,seqcal-profile ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
tail -3 "$OUT/bench.log" | head -1
cp /tmp/seqcal-gpu-bench/seqcal.trace.json "$OUT/" 2>/dev/null
tar czf "$OUT/bench-logs.tgz" -C /tmp/seqcal-gpu-bench --exclude='out-*' --exclude=model . 2>/dev/null

echo "== device-facing tests, CUDA visible"
# The tests whose runs put weights or activations on the execution device (tracing and the zoo are CPU work).
SUITE=$(grep -v "^#" benchmarks/gpu/gpu_suite.txt)
PYTHONPATH=$SEQ timeout ${SUITE_SECONDS:-200} $PY -m pytest -p no:cacheprovider -n 14 -rfE --tb=short $SUITE -k "not zoo" 2>&1 \
  | tee "$OUT/suite.log" | grep -E "FAILED|ERROR|passed|failed|^E " | tail -25

echo "== benchmark table"
sed -n '/^run /,$p' "$OUT/bench.log"
