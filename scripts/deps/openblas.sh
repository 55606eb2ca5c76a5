#!/usr/bin/env bash
# OpenBLAS for the CPU GEMMs (optional at run time: rtune falls back to candle's gemm without it;
# with it the BLAS path is what the tests exercise). Debian's package; skipped where apt cannot run.
set -euo pipefail
if ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
  . "$(dirname "$0")/apt.sh"
  apt_install libopenblas0-pthread \
    || echo "deps: could not install libopenblas0-pthread; CPU matmuls fall back to candle's gemm" >&2
fi
