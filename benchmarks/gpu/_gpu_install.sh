# Sourced by the GPU scripts (gpu_check.sh, gpu_1b.sh, gpu_all.sh) with PY and INSTALL_LOG set: installs the
# wheels that benchmarks/gpu/gpu_prepare.sh put in .whl/ into a private site folder per tool (their versions of
# compressed-tensors differ), once per machine (a folder already there is kept; SKIP_INSTALL=1 skips both), and
# sets SEQ, the PYTHONPATH of seqcal's runs.
gpu_install() {  # gpu_install TARGET WHEEL...
  local target=$1; shift
  [ -d "$target" ] && return
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$@" \
    >>"$INSTALL_LOG" 2>&1 || echo "install into $target failed (see $INSTALL_LOG)"
}
if [ -z "${SKIP_INSTALL:-}" ]; then
  gpu_install /tmp/seqcal-site .whl/common/*.whl .whl/seqcal/*.whl .whl/peer/datasets-*.whl .whl/peer/dill-*.whl \
    .whl/peer/multiprocess-*.whl
  gpu_install /tmp/peer-site .whl/common/*.whl .whl/peer/*.whl
fi
SEQ=/tmp/seqcal-site:$PWD/src
