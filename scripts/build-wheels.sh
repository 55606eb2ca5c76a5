#!/usr/bin/env bash
# scripts/build-wheels.sh [--cuda] [--profile NAME] [--out DIR] — the `pip install rtune` wheels.
#
# Builds the CPU wheel (pyproject.toml: the `rtune` binary, no cargo features, manylinux_2_35 x86_64)
# with maturin into DIR (default: $CARGO_TARGET_DIR/wheels, i.e. target/wheels), then prints what each
# executable in a wheel links and the newest glibc symbol it uses (no newer than the wheel's manylinux
# tag, or the script fails). maturin (pinned below) is installed into a venv of
# its own under ~/.cache/rtune-deps/maturin the first time (~10 s). The release wheel is built from the
# same profile as `cargo build --release` into the same target dir, so after `cargo run --release` only
# the binary's own crate is compiled again (stripped: ~1 min); from a clean tree it is a full release
# build (~16 CPU-minutes).
#
# --profile NAME: a cargo profile other than release (scripts/test-wheel.sh builds `dev`, to reuse the
#   debug build scripts/test.sh leaves in target/).
# --cuda: also the CUDA 13 wheel `rtune-cu13` (python/rtune-cu13/pyproject.toml): `rtune-cuda`, the
#   binary with feature `cuda` (depends on NVIDIA's CUDA 13.0 runtime wheels; PTX for compute_80, cubins
#   of rtune's kernels for sm_80 and sm_90; CUDA_COMPUTE_CAP overrides), built by cargo in its own
#   target dir ($CARGO_TARGET_DIR/cuda-wheel), and `rtune`, the launcher that starts it when the NVIDIA
#   driver is there and says "no CUDA device" when not (python/rtune-cu13/launcher, built by maturin in
#   $CARGO_TARGET_DIR/cuda-launcher). nvcc comes from ../shared/cuda/toolchain.sh (as in
#   benches/gpu/build.sh) or from PATH. A clean build takes ~25 minutes on 2 cores. Built with
#   `--profile dev` on a GPU-less machine (~20 min clean) and installed into a fresh venv (pip pulls
#   NVIDIA's wheels; RUNPATH finds them; without a driver `rtune` prints its one line, exit 2); not run
#   on a GPU yet.
set -euo pipefail
cd "$(dirname "$0")/.."

maturin_version=1.16.0
cuda=0
profile=release
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --profile) profile=${2:?--profile needs a cargo profile name}; shift ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "build-wheels.sh: unknown argument \`$1\` (--cuda, --profile NAME, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done

# Absolute paths: the CUDA wheel is built from python/rtune-cu13/.
target=${CARGO_TARGET_DIR:-target}
mkdir -p "$target"
target=$(cd "$target" && pwd)
out=${out:-$target/wheels}
mkdir -p "$out"
out=$(cd "$out" && pwd)

venv=${XDG_CACHE_HOME:-$HOME/.cache}/rtune-deps/maturin
maturin=$venv/bin/maturin
if [ "$("$maturin" --version 2>/dev/null || true)" != "maturin $maturin_version" ]; then
  echo "build-wheels.sh: installing maturin $maturin_version into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "maturin==$maturin_version"
fi

# Each executable the wheel installs (its `<name>.data/scripts/`): its size, the shared libraries it
# needs, its RUNPATH, its newest glibc symbol version, which must not be newer than the wheel's
# manylinux tag (maturin audits the binaries it builds; the CUDA wheel's `rtune-cuda` is not one).
describe() {
  local wheel=$1 dir bin glibc tag
  dir=$(mktemp -d)
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$dir"
  echo "$wheel: $(stat -c %s "$wheel" | awk '{printf "%.1f MB", $1 / 1e6}')"
  tag=$(basename "$wheel" | sed -n 's/.*manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1.\2/p')
  for bin in "$dir"/*.data/scripts/*; do
    echo "  $(basename "$bin"): $(stat -c %s "$bin" | awk '{printf "%.1f MB", $1 / 1e6}')"
    command -v readelf >/dev/null 2>&1 || continue
    readelf -d "$bin" | awk '/NEEDED/ {printf " %s", $NF} END {print ""}' | sed 's/^/    needs:/'
    readelf -d "$bin" | awk '/RUNPATH|RPATH/ {print "    runpath: " $NF}'
    glibc=$(readelf -V "$bin" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
    echo "    newest glibc symbol: GLIBC_$glibc"
    if [ -n "$tag" ] && [ "$(printf '%s\n%s\n' "$glibc" "$tag" | sort -V | tail -1)" != "$tag" ]; then
      echo "build-wheels.sh: $(basename "$bin") needs GLIBC_$glibc, newer than the wheel's manylinux tag ($tag)" >&2
      rm -rf "$dir"
      exit 1
    fi
  done
  rm -rf "$dir"
}

# The CPU wheel. maturin checks the manylinux policy (pyproject: auditwheel = "check").
CARGO_TARGET_DIR=$target "$maturin" build --profile "$profile" --out "$out"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
describe "$(ls -t "$out"/rtune-"$version"-*.whl | head -1)"

if [ "$cuda" = 1 ]; then
  # Built and installed on a GPU-less machine (issue 35): every library but the driver's libcuda.so.1
  # resolves from NVIDIA's wheels through the RUNPATH `describe` prints, and the launcher reports the
  # missing driver; on a GPU machine the next check is `rtune selftest` from a fresh venv with this
  # wheel installed.
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80} # PTX the driver JIT-compiles for Ampere and newer
  if [ -x ../shared/cuda/toolchain.sh ]; then
    eval "$(../shared/cuda/toolchain.sh)"
  elif ! command -v nvcc >/dev/null 2>&1; then
    echo "build-wheels.sh: --cuda needs nvcc 13.0 (../shared/cuda/toolchain.sh or PATH)" >&2
    exit 2
  fi
  # libnccl for the link (crates/dist's NCCL all-reduce), from NVIDIA's wheel in the toolchain's
  # venv as benches/gpu/build.sh takes it; with nvcc from PATH the system's libnccl is used.
  cuda_venv=${RTUNE_CUDA_HOME:-$HOME/.cache/rtune-cuda}/venv
  if [ -x "$cuda_venv/bin/pip" ]; then
    nccl=$(ls -d "$cuda_venv"/lib/python3*/site-packages/nvidia/nccl/lib 2>/dev/null | head -1 || true)
    if [ -z "$nccl" ]; then
      "$cuda_venv/bin/pip" install -q "nvidia-nccl-cu13==2.*" >&2
      nccl=$(ls -d "$cuda_venv"/lib/python3*/site-packages/nvidia/nccl/lib | head -1)
    fi
    [ -e "$nccl/libnccl.so" ] || ln -sf libnccl.so.2 "$nccl/libnccl.so"
    export LIBRARY_PATH="$nccl${LIBRARY_PATH:+:$LIBRARY_PATH}"
  fi
  # The wheel holds two executables (python/rtune-cu13/pyproject.toml): `rtune-cuda`, the CUDA binary,
  # built here by cargo, and `rtune`, the launcher (python/rtune-cu13/launcher), built by maturin,
  # which execs `rtune-cuda` when the driver's libcuda.so.1 loads and otherwise says "no CUDA device".
  # The CUDA binary: the root crate with feature `cuda`, in a target dir of its own (the CPU build's
  # stays valid), no debug info, stripped (as maturin strips what it builds), with a RUNPATH to NVIDIA's
  # wheels in site-packages/nvidia/{cu13,nccl}/lib relative to its own place, <prefix>/bin/rtune-cuda ->
  # <prefix>/lib/python3.X/site-packages (venv, conda, `pip install --user`), for Python 3.9 to 3.14:
  # no LD_LIBRARY_PATH needed. `cargo rustc` gives these flags to the binary's crate alone.
  rpath=""
  for minor in 9 10 11 12 13 14; do
    for lib in cu13 nccl; do
      rpath+="${rpath:+:}\$ORIGIN/../lib/python3.$minor/site-packages/nvidia/$lib/lib"
    done
  done
  CARGO_TARGET_DIR=$target/cuda-wheel CARGO_PROFILE_RELEASE_DEBUG=0 \
    cargo rustc --locked --profile "$profile" --features cuda --bin rtune \
    -- -C "link-arg=-Wl,-rpath,$rpath" -C strip=symbols
  case "$profile" in
    dev | test) profile_dir=debug ;;
    bench) profile_dir=release ;;
    *) profile_dir=$profile ;;
  esac
  # Into the wheel as <name>.data/scripts/rtune-cuda (pyproject: data = "wheel-data"; maturin copies
  # the file a link points at), which pip installs beside `rtune` in the environment's bin/.
  data=python/rtune-cu13/wheel-data
  rm -rf "$data"
  mkdir -p "$data/scripts"
  ln -s "$target/cuda-wheel/$profile_dir/rtune" "$data/scripts/rtune-cuda"
  # The launcher: its own target dir (its bin is named `rtune` too: in cuda-wheel/ it would replace
  # the CUDA binary, and in $target the CPU one).
  (cd python/rtune-cu13 && CARGO_TARGET_DIR=$target/cuda-launcher "$maturin" build --profile "$profile" --out "$out")
  describe "$(ls -t "$out"/rtune_cu13-"$version"-*.whl | head -1)"
fi
