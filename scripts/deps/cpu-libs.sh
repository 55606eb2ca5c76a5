#!/usr/bin/env bash
# oneDNN 3.x and Intel MKL from PyPI, for the tests that load each engine beside Debian's oneDNN 2.6
# and OpenBLAS (crates/backend/src/onednn/tests.rs, crates/backend/src/blas/mkl.rs): installed into
# a cached venv, whose lib/ scripts/test.sh names in RTUNE_TEST_ONEDNN3 and RTUNE_TEST_MKL. rtune
# never needs them (it dlopens whichever is there). `onednn-cpu-gomp` is the CPU-only 3.x build
# (GNU OpenMP, ~180 MB): the 2026 `onednn` wheel runs on SYCL and finds no CPU device here.
# ~1 GB installed with MKL's dependencies (intel-openmp, tbb); a warm cache skips pip.
set -euo pipefail
venv=${XDG_CACHE_HOME:-$HOME/.cache}/rtune-deps/cpu-libs
if [ ! -e "$venv/lib/libdnnl.so.3" ] || [ ! -e "$venv/lib/libmkl_rt.so.3" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "onednn-cpu-gomp==2023.2.0" "mkl==2026.*" \
    || echo "deps: could not install onednn-cpu-gomp and mkl; their tests check only the system's libraries" >&2
fi
