#!/usr/bin/env bash
# The README's test command: installs what the tests need (scripts/deps/*.sh, each idempotent and
# quick once done), then runs the whole test suite. `.ci/run` calls this after its lint steps.
# Extra arguments go to the main `cargo test` run (e.g. a test-name filter).
set -euo pipefail
cd "$(dirname "$0")/.."
for dep in scripts/deps/*.sh; do
  [ "$(basename "$dep")" = apt.sh ] && continue
  echo "test.sh: $dep" >&2
  bash "$dep"
done
# The PyPI engines scripts/deps/cpu-libs.sh installed: their tests load them by these paths (and
# fail when a set path does not load).
cpu_libs=${XDG_CACHE_HOME:-$HOME/.cache}/rtune-deps/cpu-libs/lib
if [ -e "$cpu_libs/libdnnl.so.3" ] && [ -e "$cpu_libs/libmkl_rt.so.3" ]; then
  export RTUNE_TEST_ONEDNN3=$cpu_libs/libdnnl.so.3 RTUNE_TEST_MKL=$cpu_libs/libmkl_rt.so.3
fi
cargo test --workspace --locked "$@"
# The data-parallel tests (issue 16): only the rtune binary and the `dist` test target are built
# with the `mpi` feature (the MPI binding lives in the binary), run under `mpirun -np 2`.
# They are part of the suite: without Open MPI they fail (scripts/deps/openmpi.sh installs it).
cargo test --locked --features mpi --test dist
