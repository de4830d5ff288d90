#!/usr/bin/env bash
# Create the peer venv used by benchmarks/tracing/trace_matrix.py: llm-compressor 0.14.0.1 beside seqcal.
#
# Idempotent: an existing venv that already imports llmcompressor 0.14.0.1 is left as it is.
# torch is installed first and pinned, so that llmcompressor's own torch requirement is already
# met by the local CPU wheel instead of pulling a multi-GB CUDA build. llmcompressor 0.14 needs
# transformers <= 5.17, older than the 5.24 in seqcal's .venv.
#
# Usage: bash benchmarks/setup_peer.sh            (from anywhere; the venv lands in <repo>/.peer-venv)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PEER_VENV:-$REPO/.peer-venv}"
PY="$VENV/bin/python"
TORCH_VERSION="2.13.0"
PEER_VERSION="0.14.0.1"

if [[ -x "$PY" ]] && "$PY" - "$PEER_VERSION" "$TORCH_VERSION" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import version
peer, torch = sys.argv[1], sys.argv[2]
ok = version("llmcompressor") == peer and version("torch").split("+")[0] == torch
sys.exit(0 if ok else 1)
PYEOF
    echo "setup_peer: $VENV already has llmcompressor $PEER_VERSION and torch $TORCH_VERSION"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    echo "setup_peer: creating $VENV"
    python3 -m venv "$VENV"
fi
# torch first and alone: see the header.
"$PY" -m pip install --quiet "torch==$TORCH_VERSION"
"$PY" -m pip install --quiet "torch==$TORCH_VERSION" "llmcompressor==$PEER_VERSION" 'transformers<=5.17'
"$PY" - <<'PYEOF'
from importlib.metadata import version
print("setup_peer: ready:", ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "llmcompressor")))
PYEOF
