#!/usr/bin/env bash
# Open MPI for the data-parallel tests (`cargo test --features mpi --test dist`, run by
# scripts/test.sh): `mpirun` (openmpi-bin), the headers and `mpicc` that rsmpi's build probes
# (libopenmpi-dev), and libclang for mpi-sys's bindgen (libclang-dev: libclang.so and clang's
# own headers). Debian's packages; skipped where apt cannot run (scripts/test.sh then skips the
# distributed tests).
set -euo pipefail
if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 \
  || ! ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1; then
  . "$(dirname "$0")/apt.sh"
  apt_install openmpi-bin libopenmpi-dev libclang-dev \
    || echo "deps: could not install openmpi-bin libopenmpi-dev libclang-dev; the MPI tests are skipped" >&2
fi
