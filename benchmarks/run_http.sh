#!/usr/bin/env bash
# The report's HTTP figures: gateway + one SmolLM2 worker on this host, the load generator in
# closed loop at concurrency 1, 4, 8, 16, then an open-loop rate sweep (the hockey stick).
#   bash benchmarks/run_http.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8123}
mkdir -p "$OUT"
PORT=$PORT KESTREL_LOG_LEVEL=WARNING \
  "$PY" -m kestrel.serve > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health/ready" > /dev/null; do sleep 1; done
URL="http://127.0.0.1:$PORT/v1"
"$PY" -m loadgen.cli run --base-url "$URL" --num-requests 4 --prompt-len fixed:16 \
  --output-len fixed:8 --no-progress > /dev/null   # warm-up
: > "$OUT/http.md"
for c in 1 4 8 16; do
  n=$(( c < 4 ? 6 : 2 * c ))
  "$PY" -m loadgen.cli run --base-url "$URL" --mode closed --concurrency "$c" \
    --num-requests "$n" --prompt-len fixed:128 --output-len fixed:128 --seed 0 \
    --slo-ttft-ms 2000 --slo-tpot-ms 200 --no-progress --title "closed loop, concurrency $c" \
    --out "$OUT/http_c$c.json" --markdown "$OUT/http.md"
done
"$PY" -m loadgen.cli sweep --base-url "$URL" --rates "${RATES:-0.25,0.5,1,2,4}" \
  --num-requests "${SWEEP_N:-24}" --prompt-len fixed:128 --output-len fixed:64 --seed 0 \
  --no-progress --plot "$OUT/hockey_stick.png" --out "$OUT/sweep.json" --markdown "$OUT/sweep.md"
