#!/usr/bin/env bash
# Every GPU check and the 1B comparison in one command, for a GPU machine held for a few minutes (one start):
#   1. tests/test_cuda.py,
#   2. seqcal, then llm-compressor 0.14, on the 1B Llama of gpu_1b.sh (GPTQ W4A16 g128, 256 x 2048, defaults),
#   3. where seqcal's peak device memory goes (gpu_peak.py: the blocks alive at the peak, by the line that made them),
#   4. seqcal again with --profile (where its time goes; the cache's copies and the checkpoint's writes on their
#      own streams and thread show as overlap),
#   5. seqcal with the activation cache's copies on the compute stream (what the side streams save),
#   6. seqcal with the activation cache in the GPU's memory (--offload device: no PCIe traffic),
#   7. gpu_check.sh's device-facing suite,
#   8. seqcal with new pinned host memory paged in by 8 threads (torch's cudaHostRegister allocator setting),
#   9. seqcal without the column-loop graphs (what they save on the whole run),
#  10. the Hessian and solve kernels alone (gpu_solve.py: column loop eager, graph captured, graph cached),
#  11. seqcal with its checkpoint files written before the next subgraph starts (what the worker thread saves),
# each with its own time limit, cut so that all of it ends within SECONDS (default 570) of the start; a stage
# without at least its minimum time left is skipped and says so.
#   bash benchmarks/gpu/gpu_all.sh [SECONDS]
# Wheels and the carried SmolLM2 config/tokenizer come from benchmarks/gpu/gpu_prepare.sh (.whl/, .gpu/); logs and
# results go to $OUT (default /tmp/seqcal-gpu-out): the logs and the profile's trace packed in logs.tgz at the end.
set -u
END=$(($(date +%s) + ${1:-570}))
OUT=${OUT:-/tmp/seqcal-gpu-out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc
} 2>&1 | tee "$LOGS/env.txt"
INSTALL_LOG="$LOGS/install.log"
# shellcheck source=benchmarks/gpu/_gpu_install.sh
source benchmarks/gpu/_gpu_install.sh  # the prepared wheels, once per machine; sets SEQ
export SEQ PY LOGS

limit() {  # limit WANT MIN: seconds for a stage, at most WANT and what is left; 0 when under MIN are left
  local left=$((END - $(date +%s)))
  local want=$(( $1 < left ? $1 : left ))
  echo $(( want < $2 ? 0 : want ))
}
stage() {  # stage NAME WANT MIN COMMAND...: run COMMAND under its limit, or say why not
  local name=$1 t; t=$(limit "$2" "$3"); shift 3
  if [ "$t" -eq 0 ]; then echo "== $name: skipped ($((END - $(date +%s))) s left)"; return; fi
  echo "== $name (limit $t s)"
  local start; start=$(date +%s)
  timeout "$t" "$@"
  echo "   $name: exit $?, $(($(date +%s) - start)) s"
}
bench() {  # bench RUNS SECONDS: gpu_bench.py on the 1B model, the model and tokens built once
  PYTHONPATH=$SEQ $PY benchmarks/gpu/gpu_bench.py --config-dir .gpu/tok --shape 1b --samples 256 --seq 2048 \
    --group-size 128 --reuse --work /tmp/seqcal-gpu-1b --out "$LOGS/gpu_1b_${1//,/_}.json" --runs "$1" \
    --seqcal-path "$SEQ" --peer-path /tmp/peer-site --timeout "$2" 2>&1 | tail -4
}
export -f bench

stage "tests/test_cuda.py" 100 30 bash -c 'PYTHONPATH=$SEQ $PY -m pytest -q -o addopts="" -p no:cacheprovider tests/test_cuda.py \
  >"$LOGS/test_cuda.log" 2>&1'
tail -6 "$LOGS/test_cuda.log"
stage "1B: seqcal (defaults)" 200 60 bash -c 'bench seqcal 190'
stage "1B: llm-compressor (defaults)" 230 120 bash -c 'bench llmc 220'
stage "1B: seqcal's device peak, 64 samples (gpu_peak.py)" 90 40 bash -c 'SEQCAL_BENCH_GROUP_SIZE=128 PYTHONPATH=$SEQ \
  $PY benchmarks/gpu/gpu_peak.py --report "$LOGS/peak.txt" benchmarks/_lib/run_seqcal.py --algo gptq --dtype bfloat16 \
  --model /tmp/seqcal-gpu-1b/model --tokens /tmp/seqcal-gpu-1b/tokens.safetensors --samples 64 \
  --out /tmp/seqcal-gpu-1b/out-peak >"$LOGS/peak.log" 2>&1'
cat "$LOGS/peak.txt" 2>/dev/null
stage "1B: seqcal --profile" 120 70 bash -c 'bench seqcal-profile 110'
stage "1B: seqcal, copies on the compute stream" 120 70 bash -c 'bench seqcal-sync 110'
stage "1B: seqcal, activation cache on the GPU" 120 70 bash -c 'bench seqcal-devcache 110'
export SUITE=$(grep -v "^#" benchmarks/gpu/gpu_suite.txt)
stage "device-facing suite, CUDA visible" 200 40 bash -c 'PYTHONPATH=$SEQ $PY -m pytest -p no:cacheprovider -n 14 \
  -rfE --tb=short $SUITE -k "not zoo" >"$LOGS/suite.log" 2>&1'
grep -E "FAILED|ERROR|passed|failed|^E " "$LOGS/suite.log" 2>/dev/null | tail -25
stage "1B: seqcal, pinned memory by cudaHostRegister" 120 70 bash -c 'bench seqcal-register 110'
stage "1B: seqcal, eager column loop" 120 70 bash -c 'bench seqcal-eager 110'
stage "kernels alone (gpu_solve.py)" 70 30 bash -c 'PYTHONPATH=$SEQ $PY benchmarks/gpu/gpu_solve.py >"$LOGS/gpu_solve.txt" 2>&1'
cat "$LOGS/gpu_solve.txt" 2>/dev/null
stage "1B: seqcal, checkpoint written synchronously" 120 70 bash -c 'bench seqcal-syncsave 110'
cp /tmp/seqcal-gpu-1b/*.log /tmp/seqcal-gpu-1b/seqcal.trace.json "$LOGS/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit 0
