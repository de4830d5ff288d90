#!/usr/bin/env bash
# seqcal vs llm-compressor 0.14 on a GPU at the size users calibrate: a Llama-architecture model of 1.07B
# parameters (random bf16 weights), GPTQ W4A16 g128, 256 x 2048 random tokens, both tools at their defaults.
# One tool per call, so each call fits a device command's time limit; the second call reuses the model and
# tokens the first one built when the machine is still the same:
#   bash benchmarks/gpu/gpu_1b.sh seqcal-profile [--cuda-tests | --solve]     then     bash benchmarks/gpu/gpu_1b.sh llmc
# Wheels and the carried SmolLM2 config/tokenizer come from benchmarks/gpu/gpu_prepare.sh (.whl/, .gpu/).
set -u
RUNS=${1:?which runs: seqcal, seqcal-profile, llmc, ... (benchmarks/gpu/gpu_bench.py RUNS)}
OUT=${OUT:-/tmp/seqcal-gpu-out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/env.txt"
INSTALL_LOG="$OUT/install.log"
# shellcheck source=benchmarks/gpu/_gpu_install.sh
source benchmarks/gpu/_gpu_install.sh  # the prepared wheels, once per machine; sets SEQ
if [ "${2:-}" = "--solve" ]; then  # the Hessian and GPTQ-solve kernels alone, old and new (seconds)
  PYTHONPATH=$SEQ timeout ${SOLVE_SECONDS:-90} $PY benchmarks/gpu/gpu_solve.py 2>&1 | tee "$OUT/gpu_solve.txt"
fi
if [ "${2:-}" = "--cuda-tests" ]; then
  echo "== tests/test_cuda.py"
  PYTHONPATH=$SEQ timeout ${CUDA_TEST_SECONDS:-90} $PY -m pytest -q -o addopts="" -p no:cacheprovider tests/test_cuda.py 2>&1 \
    | tee "$OUT/test_cuda.log" | tail -8
fi
echo "== $RUNS on the 1B model"
PYTHONPATH=$SEQ $PY benchmarks/gpu/gpu_bench.py --config-dir .gpu/tok --shape 1b --samples 256 --seq 2048 \
  --group-size 128 --reuse --work /tmp/seqcal-gpu-1b --out "$OUT/gpu_1b_${RUNS//,/_}.json" --runs "$RUNS" \
  --seqcal-path "$SEQ" --peer-path /tmp/peer-site --timeout ${RUN_SECONDS:-240} 2>&1 | tee "$OUT/bench_1b.log" | tail -4
cp /tmp/seqcal-gpu-1b/*.log "$OUT/" 2>/dev/null
cp /tmp/seqcal-gpu-1b/seqcal.trace.json "$OUT/seqcal-1b.trace.json" 2>/dev/null
exit 0
