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
cargo test --workspace --locked "$@"
