#!/usr/bin/env bash
# Valgrind (Debian's `valgrind`) for tests/integration/readme.rs: the README's trace of one training
# step is checked against the files callgrind sees that step execute.
set -euo pipefail
if ! command -v valgrind >/dev/null 2>&1; then
  . "$(dirname "$0")/apt.sh"
  apt_install valgrind \
    || { echo "deps: could not install valgrind (needed by the README's step-trace test)" >&2; exit 1; }
fi
