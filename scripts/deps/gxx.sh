#!/usr/bin/env bash
# g++ with C++20 (Debian's `g++`, 12 on bookworm) for crates/ops/tests/kernels_emulated.rs: the CUDA
# kernels are compiled for the host under scripts/flash-emu's emulation and checked against the ops'
# references on every run without a GPU.
set -euo pipefail
if ! command -v g++ >/dev/null 2>&1; then
  . "$(dirname "$0")/apt.sh"
  apt_install g++ \
    || { echo "deps: could not install g++ (needed by the emulated kernel tests)" >&2; exit 1; }
fi
