#!/usr/bin/env bash
# Tokenisation throughput and memory: a generated ~100 MB chat JSONL through `rtune data prepare`
# (chat template render + role masks + tokenizer, all cores, streamed into the cache).
#   bash benches/tokenize.sh [MB]      (default 100; needs a release build: cargo build --release)
# Prints rows, tokens, tokens/s and the peak RSS of the run next to the file size.
set -euo pipefail
cd "$(dirname "$0")/.."
mb=${1:-100}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work/chat.jsonl" "$mb" <<'PY'
import json, random, sys
path, mb = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
words = ("kettle zephyr nimbus oslo sings water boil steam lid handle copper blue warranty "
         "order ship return price colour model labs support battery timer").split()
def sentence(n):
    return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."
with open(path, "w") as f:
    size = 0
    while size < mb * 1_000_000:
        msgs = [{"role": "system", "content": sentence(8)}]
        for _ in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": sentence(rng.randint(5, 20))})
            msgs.append({"role": "assistant", "content": sentence(rng.randint(10, 60))})
        line = json.dumps({"messages": msgs}) + "\n"
        f.write(line)
        size += len(line)
PY
cat > "$work/tok.toml" <<TOML
[model]
path = "tests/fixtures/tiny-llama3"
[data]
train = "$work/chat.jsonl"
max_seq_len = 4096
cache_dir = "$work/cache"
[output]
dir = "$work/run"
TOML
bytes=$(stat -c %s "$work/chat.jsonl")
/usr/bin/time -f "%M" -o "$work/rss" ./target/release/rtune data prepare --config "$work/tok.toml" | tee "$work/out"
peak_kib=$(cat "$work/rss")
echo "file: $((bytes / 1000000)) MB; peak RSS: $((peak_kib / 1024)) MiB ($(python3 -c "print(f'{$peak_kib*1024/$bytes:.2f}')")× the file)"
