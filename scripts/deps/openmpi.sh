#!/usr/bin/env bash
# Open MPI for the data-parallel tests (`cargo test --features mpi --test dist`, run by
# scripts/test.sh): `mpirun` (openmpi-bin), the headers and `mpicc` that rsmpi's build probes
# (libopenmpi-dev), and libclang for mpi-sys's bindgen (libclang-dev: libclang.so and clang's
# own headers). Debian's packages; where apt cannot run, the build of the
# distributed tests fails and says what is missing.
set -euo pipefail
if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 \
  || ! ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1; then
  . "$(dirname "$0")/apt.sh"
  apt_install openmpi-bin libopenmpi-dev libclang-dev \
    || { echo "deps: could not install openmpi-bin libopenmpi-dev libclang-dev (needed by the MPI tests)" >&2; exit 1; }
fi
