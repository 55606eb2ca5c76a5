#!/usr/bin/env bash
# benches/gpu/fetch-wheels.sh — run once here (needs PyPI): puts the wheels the H200 machine lacks into
# .whl/ at the repo root (git-ignored through .git/info/exclude), for `run` calls to carry.
#
# The machine (KINDS.md) has torch 2.11+cu130, transformers, peft, accelerate, numpy and packaging, but
# no bitsandbytes. bitsandbytes 0.50.2 (the newest; it ships libbitsandbytes_cuda130.so) needs only
# torch, numpy and packaging: nothing else to fetch. Its PyPI wheel is 43 MB because it carries a
# library per CUDA/ROCm/XPU version; with the ~40 MB rtune binary that breaks the 64 MiB a call may
# carry. So the wheel is repacked without the libraries that machine never loads (bnb picks
# libbitsandbytes_cuda<torch.version.cuda>.so: cuda130 there; cpu kept for CPU runs):
# ~3.6 MB, same name and version, RECORD rewritten to match.
#
# Env: PYTHON (a python with pip; default python3), BNB_VERSION (0.50.2), KEEP (libs to keep).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
BNB_VERSION=${BNB_VERSION:-0.50.2}
KEEP=${KEEP:-cpu cuda130}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/rtune-wheels
mkdir -p .whl "$cache"
# git's own path for it: .git is a file in a worktree or submodule, and info/ may be missing.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

# The platform list of device/README.md, plus manylinux_2_24 (what bitsandbytes publishes: pip matches
# the N of manylinux_2_N exactly).
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plats+=(--platform "$p"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" -d "$cache" "bitsandbytes==$BNB_VERSION"
full=$(compgen -G "$cache/bitsandbytes-$BNB_VERSION-*.whl" | head -1)

rm -f .whl/bitsandbytes-*.whl   # one version only: two stop the install on the machine
KEEP=$KEEP "$PYTHON" - "$full" ".whl/$(basename "$full")" <<'PY'
import os, re, sys, zipfile
src, dst = sys.argv[1:]
keep = {f"libbitsandbytes_{k}.so" for k in os.environ["KEEP"].split()}
def wanted(name):
    base = name.rsplit("/", 1)[-1]
    return not re.fullmatch(r"libbitsandbytes_.*\.so", base) or base in keep
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = zin.namelist()
    missing = keep - {n.rsplit("/", 1)[-1] for n in names}
    if missing:
        sys.exit(f"{src} lacks {sorted(missing)}")
    for info in zin.infolist():
        if not wanted(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):  # drop the lines of the files left out
            data = "".join(l for l in data.decode().splitlines(True) if wanted(l.split(",", 1)[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"kept {len([n for n in zipfile.ZipFile(dst).namelist()])} of {len(names)} files")
PY
ls -l "$full" .whl/
du -cb .whl/*.whl | tail -1 | awk '{printf "carried wheels: %.1f MB\n", $1 / 1e6}'
