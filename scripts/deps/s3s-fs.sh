#!/usr/bin/env bash
# s3s-fs: an S3-compatible server (signature checks over a local directory) that
# tests/integration/remote.rs starts on 127.0.0.1. 0.14.1 is the newest that builds on rustc 1.95.
# Installed under ~/.cache/rtune-deps/s3s-fs (the path the tests look at); quick once present.
set -euo pipefail
root="${XDG_CACHE_HOME:-$HOME/.cache}/rtune-deps/s3s-fs"
if [ ! -x "$root/bin/s3s-fs" ]; then
  echo "deps: installing s3s-fs 0.14.1 into $root (a few minutes)" >&2
  cargo install s3s-fs --version 0.14.1 --features binary --locked --root "$root" -q
fi
