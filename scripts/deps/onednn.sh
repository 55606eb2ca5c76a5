#!/usr/bin/env bash
# oneDNN (Debian's libdnnl2, oneDNN 2.x) for the bf16 GEMMs on CPUs with AVX-512 BF16 or AMX
# (optional at run time: rtune dlopens it and falls back to its own bf16 path without it; see
# crates/backend/src/onednn/). Debian's package; skipped where apt cannot run.
set -euo pipefail
if ! ldconfig -p 2>/dev/null | grep -q 'libdnnl\.so\.2'; then
  . "$(dirname "$0")/apt.sh"
  apt_install libdnnl2 \
    || echo "deps: could not install libdnnl2; bf16 matmuls use rtune's fallback path" >&2
fi
