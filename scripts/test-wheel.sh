#!/usr/bin/env bash
# scripts/test-wheel.sh [WHEEL] — the CPU wheel installs with pip and works: `.ci/run` runs it after
# scripts/test.sh.
#
# Builds the CPU wheel (scripts/build-wheels.sh) into a temp dir, `pip install --no-index`es it into a
# fresh venv there (no network: a bin wheel with no dependencies), and runs the installed `rtune` from
# the venv's PATH: `--version` must name the Cargo version and the cpu build, the README's smoke job
# must finish (the adapter and summary.json written, 150 steps, final loss finite and < 0.05, as
# tests/integration/cli.rs asks) and the trained adapter must answer the README's prompt.
#
# The wheel is built with the `dev` profile (RTUNE_WHEEL_PROFILE overrides): after scripts/test.sh
# that reuses the debug build in target/ (same features: no dependency is compiled again, only the
# binary's own crate), where a release build would compile everything again (~16 CPU-minutes). The
# packaging, the manylinux audit and the binary's behaviour are the same; the release wheel is
# scripts/build-wheels.sh's. With WHEEL given, that wheel is tested instead and nothing is built.
set -euo pipefail
[ $# -eq 0 ] || set -- "$(realpath "$1")" # before the cd below
cd "$(dirname "$0")/.."
start=$SECONDS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rtune-wheel.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

if [ $# -gt 0 ]; then
  wheel=$1
else
  scripts/build-wheels.sh --profile "${RTUNE_WHEEL_PROFILE:-dev}" --out "$tmp/wheels"
  wheel=$(ls "$tmp"/wheels/rtune-*.whl)
fi
echo "test-wheel.sh: wheel ready after $((SECONDS - start)) s: $(basename "$wheel")" >&2

python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --disable-pip-version-check --no-index "$wheel"
export PATH="$tmp/venv/bin:$PATH"
[ "$(command -v rtune)" = "$tmp/venv/bin/rtune" ] \
  || { echo "test-wheel.sh: the wheel put no rtune in $tmp/venv/bin" >&2; exit 1; }

fail() { echo "test-wheel.sh: $*" >&2; exit 1; }
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
got=$(rtune --version)
[ "$got" = "rtune $version (cpu)" ] || fail "rtune --version printed \`$got\`, not \`rtune $version (cpu)\`"
echo "test-wheel.sh: $got" >&2

# The README's smoke job (paths in configs/smoke.toml are relative to the repository root).
rtune train --config configs/smoke.toml --set "output.dir=$tmp/smoke" >"$tmp/train.log" 2>&1 \
  || { cat "$tmp/train.log" >&2; fail "rtune train --config configs/smoke.toml failed"; }
for f in adapter_model.safetensors adapter_config.json summary.json; do
  [ -s "$tmp/smoke/$f" ] || fail "the smoke run wrote no $f"
done
python3 - "$tmp/smoke/summary.json" <<'PY' || fail "the smoke run's summary.json is not a finished run"
import json, math, sys
s = json.load(open(sys.argv[1]))
loss = s["final_loss"]
print(f"test-wheel.sh: smoke: {s['steps']} steps, final loss {loss:.4f}", file=sys.stderr)
sys.exit(0 if s["steps"] == 150 and math.isfinite(loss) and loss < 0.05 else 1)
PY
reply=$(rtune generate --model tests/fixtures/tiny-llama3 --adapter "$tmp/smoke" \
  --prompt $'Q: Who makes Zephyr?\nA:' 2>/dev/null)
[ "$reply" = " Nimbus Labs, Oslo." ] || fail "generate with the smoke adapter replied \`$reply\`"
echo "test-wheel.sh: generate: \`$reply\`; passed in $((SECONDS - start)) s" >&2
