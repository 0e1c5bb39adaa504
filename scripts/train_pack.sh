#!/usr/bin/env bash
# Move training-stage outputs between this machine and the device machine within its limits
# (at most 8 files of 16 MB come back; what travels there is the working tree, at most 64 MiB).
#
#   train_pack.sh pack <stage> <run> <out>   on the device: <run>/<stage> minus its state file
#                                            (the resume state stays on the machine that made it),
#                                            as <stage>.tar.part-00, -01, ... of at most 15 MB
#   train_pack.sh unpack <folder>            here: reassemble and extract into the repo root
#   train_pack.sh carry <run>                here: drop what need not travel (token caches, states)
set -euo pipefail
case "$1" in
  pack)
    stage=$2 run=$3 out=$4
    case "$stage" in
      evaluate) tar cf - "$run/report.json" "$run/report.md" ;;
      *) tar cf - --exclude='state.pt*' "$run/$stage" ;;
    esac | split -b 15M -d -a 2 - "$out/$stage.tar.part-"
    ;;
  unpack)
    for first in "$2"/*.tar.part-00; do
      [ -e "$first" ] || continue
      cat "${first%-00}"-* | tar xf -
      echo "unpacked ${first%.tar.part-00}"
    done
    ;;
  carry)
    run=$2
    rm -f "$run"/tokens-*.npy "$run"/*/state.pt "$run"/*/state.pt.tmp
    du -sh "$run" .corpus 2>/dev/null || true
    ;;
  *) echo "usage: train_pack.sh pack|unpack|carry ..." >&2; exit 2 ;;
esac
