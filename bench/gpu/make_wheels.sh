#!/usr/bin/env bash
# Make the wheel set of bench/gpu/wheels.txt for the GPU box (CPython 3.12, manylinux x86_64, no network
# there): run here, where pip reaches a package index, then carry gpu-wheels/ to the box with the checkout.
#   bench/gpu/make_wheels.sh [OUT_DIR]          (default gpu-wheels)
# A package published only as a source archive (crafter) is built here into a wheel, which must come out
# pure Python (py3-none-any) to be of use on the box. Fails when the wheels and the tracked checkout
# together exceed the 64 MiB a GPU command may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-gpu-wheels}
python=${PYTHON:-python3}
budget=$((64 * 1024 * 1024))
reqs=$(grep -vE '^\s*(#|$)' bench/gpu/wheels.txt)
rm -rf "$out" && mkdir -p "$out"
for req in $reqs; do
  # --no-deps: wheels.txt names every dependency itself (make gpu-check DRY=1 proves the list complete)
  if ! "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      --platform any -d "$out" "$req" 2>/dev/null; then
    echo "$req: no wheel for CPython 3.12 published; building one from its source archive"
    tmp=$(mktemp -d)
    "$python" -m pip wheel -q --no-deps -w "$tmp" "$req"
    for whl in "$tmp"/*.whl; do
      case "$whl" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) mv "$whl" "$out"/ ;;
        *) echo "$whl is not pure Python: it would not run on the box" >&2; exit 1 ;;
      esac
    done
    rm -rf "$tmp"
  fi
done
count=$(ls "$out"/*.whl | wc -l)
expected=$(echo "$reqs" | wc -w)
if [ "$count" -ne "$expected" ]; then
  echo "$count wheels for $expected requirements" >&2
  exit 1
fi
wheels=$(du -cb "$out"/*.whl | tail -1 | cut -f1)
checkout=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s += $1} END {print s}')
echo "wheels: $count files, $((wheels / 1024 / 1024)) MiB; tracked checkout $((checkout / 1024 / 1024)) MiB; budget 64 MiB"
if [ $((wheels + checkout)) -gt $budget ]; then
  echo "over the 64 MiB a GPU command can carry: drop something from bench/gpu/wheels.txt" >&2
  exit 1
fi
