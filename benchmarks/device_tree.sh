#!/usr/bin/env bash
# The working tree under the device tool's 64 MiB per call: the shipped transforms files
# (src/quantmla/models/data/*.safetensors, ~54 MB, tracked) do not fit beside a carry (.flashmla, a kit part), and
# the kernel calls do not read them. For the call, swap them for empty files; after it, put them back.
#
#   bash benchmarks/device_tree.sh hide [NAME ...]   # every shipped file but the NAMEs (basenames, e.g.
#                                                    # smollm2-mla-quantmla-c4r4.safetensors, which issue 12's
#                                                    # retrieval runs read) -> .device_hidden/, an empty file left
#   bash benchmarks/device_tree.sh restore           # back in place, each checked against its sha256 at hide time
#   bash benchmarks/device_tree.sh status            # which are hidden
#
# .device_hidden/ is git-ignored (it does not travel); the index is untouched, so `git status` shows the emptied files
# as modified while they are hidden: never commit them then (`git add` by name, never -A). hide refuses while
# anything is hidden; restore refuses to overwrite a file that is no longer empty (something wrote it meanwhile).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DATA="$ROOT/src/quantmla/models/data"
HID="$ROOT/.device_hidden"
cmd=${1:?usage: device_tree.sh hide [NAME ...] | restore | status}
shift || true
case $cmd in
  hide)
    if [[ -s $HID/SHA256SUMS ]]; then
      echo "device_tree: files are already hidden ($HID): run 'device_tree.sh restore' first" >&2
      exit 1
    fi
    for keep in "$@"; do
      [[ -f $DATA/$keep ]] || { echo "device_tree: no shipped file $keep in $DATA" >&2; exit 1; }
    done
    mkdir -p "$HID"
    : >"$HID/SHA256SUMS.tmp"
    for f in "$DATA"/*.safetensors; do
      b=$(basename "$f")
      [[ " $* " == *" $b "* ]] && continue
      [[ -s $f ]] || continue
      (cd "$DATA" && sha256sum "$b") >>"$HID/SHA256SUMS.tmp"
    done
    mv "$HID/SHA256SUMS.tmp" "$HID/SHA256SUMS"  # the record first: an interrupted hide is restorable
    while read -r _ b; do
      mv "$DATA/$b" "$HID/$b" && : >"$DATA/$b"
    done <"$HID/SHA256SUMS"
    echo "device_tree: hid $(wc -l <"$HID/SHA256SUMS") file(s); tree now $(git -C "$ROOT" ls-files -z | (cd "$ROOT" &&
      xargs -0 du -cb 2>/dev/null) | tail -1 | cut -f1) bytes tracked"
    ;;
  restore)
    [[ -s $HID/SHA256SUMS ]] || { echo "device_tree: nothing hidden"; exit 0; }
    while read -r _ b; do
      if [[ -f $HID/$b ]]; then
        if [[ -s $DATA/$b ]]; then
          echo "device_tree: $DATA/$b is not empty (written since hide): left as it is, the hidden copy kept in $HID" >&2
          exit 1
        fi
        mv "$HID/$b" "$DATA/$b"
      fi
    done <"$HID/SHA256SUMS"
    (cd "$DATA" && sha256sum --quiet -c "$HID/SHA256SUMS") || { echo "device_tree: checksum mismatch" >&2; exit 1; }
    n=$(wc -l <"$HID/SHA256SUMS")
    rm -f "$HID/SHA256SUMS"
    rmdir "$HID" 2>/dev/null || true
    echo "device_tree: restored $n file(s), checksums match"
    ;;
  status)
    if [[ -s $HID/SHA256SUMS ]]; then cut -d' ' -f3 "$HID/SHA256SUMS" | sed 's/^/hidden: /'; else echo "nothing hidden"; fi
    ;;
  *)
    echo "usage: device_tree.sh hide [NAME ...] | restore | status" >&2
    exit 2
    ;;
esac
