#!/usr/bin/env bash
# Two nodes of one engine on this box: vLLM's multi-node launch (TP = 2, one rank a node, --nnodes 2,
# --master-addr, node 1 --headless) on the CPU engine with the tiny INT4 checkpoint. Three faults, each on a
# fresh pair (~8 min on 2 cores; FINDINGS.md §8 has a run):
#   A  node 1 dies: what node 0 does while idle, at its next request, and its exit code;
#   B  node 0 dies: what node 1 does (watched for 3 minutes);
#   C  the watchdog supervising node 1: node 0 dies, the watchdog finds the head lost and relaunches node 1,
#      a new node 0 starts, node 1 joins it and the engine serves again; then a clean stop, nothing left over.
# Usage: bash tests/watchdog/real_two_nodes.sh [OUT_DIR]   (needs `bash install.sh --cpu`; ADDR overrides the
# node-0 address, which must not be loopback: the preflight refuses that for --nnodes > 1, as on two hosts)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$(mkdir -p "${1:-/tmp/real_two_nodes}" && cd "${1:-/tmp/real_two_nodes}" && pwd)"
ADDR=${ADDR:-$(hostname -I | awk '{print $1}')}
MODEL=$(python3 -c "from ling_tools.tiny import ensure_tiny; print(ensure_tiny(int4=True))")
PORT=${PORT:-8021}
COMMON=("$MODEL" --tensor-parallel-size 2 --nnodes 2 --master-addr "$ADDR" --master-port 29611 --max-model-len 2048
        --max-num-batched-tokens 512 --max-num-seqs 4 --dtype float32)
CLI=(python3 "$REPO/tests/watchdog/vllm_cpu_cli.py" serve)
export VLLM_TARGET_DEVICE=cpu VLLM_LING_FORCE=1 VLLM_MLA_DISABLE=1 VLLM_CPU_CI_ENV=1 VLLM_CPU_KVCACHE_SPACE=1
export PYTHONUNBUFFERED=1
cd "$OUT"
say() { echo "$(date +%T) $*"; }
node1() { VLLM_CPU_OMP_THREADS_BIND=1 setsid "${CLI[@]}" "${COMMON[@]}" --node-rank 1 --headless > "$1" 2>&1 & N1=$!; }
node0() { VLLM_CPU_OMP_THREADS_BIND=0 setsid "${CLI[@]}" "${COMMON[@]}" --node-rank 0 --port "$PORT" > "$1" 2>&1 & N0=$!; }
ready() {
  local t0=$SECONDS
  until curl -sf "localhost:$PORT/v1/models" > /dev/null; do
    sleep 3; (( SECONDS - t0 > 600 )) && { say "node 0 not ready after 600 s"; return 1; }
  done
  say "node 0 ready after $((SECONDS - t0)) s"
}
complete() {
  curl -s -m 60 -o /dev/null -w "http %{http_code}" "localhost:$PORT/v1/completions" -H 'Content-Type: application/json' \
       -d "{\"model\": \"$MODEL\", \"prompt\": [5, 6, 7, 8], \"max_tokens\": 4, \"temperature\": 0}"
}
alive() { kill -0 "$1" 2>/dev/null && echo yes || echo no; }
cleanup() { for p in ${N0:-} ${N1:-} ${WD:-}; do kill -9 -- "-$p" 2>/dev/null; done; }
trap cleanup EXIT

say "A: node 1 dies"
node1 A-node1.log; node0 A-node0.log; ready || exit 1
say "A: request: $(complete)"; kill -9 -- "-$N1"; say "A: node 1 SIGKILLed; node 0 idle for 30 s"; sleep 30
say "A: node 0 alive: $(alive "$N0"); /health: $(curl -s -o /dev/null -w '%{http_code}' -m 5 "localhost:$PORT/health")"
say "A: request: $(complete)"; wait "$N0"; say "A: node 0 exit code $?"

say "B: node 0 dies"
node1 B-node1.log; node0 B-node0.log; ready || exit 1
say "B: request: $(complete)"; kill -9 -- "-$N0"; say "B: node 0 SIGKILLed"
for i in 1 2 3 4 5 6; do sleep 30; say "B: +$((30 * i)) s node 1 alive: $(alive "$N1")"; done
say "B: node 1's last line: $(grep -v '^\s' B-node1.log | tail -n 1 | cut -c1-160)"; kill -9 -- "-$N1" 2>/dev/null

say "C: the watchdog on node 1"
rm -rf wd; VLLM_CPU_OMP_THREADS_BIND=1 setsid python3 -m ling_watchdog --log-dir wd --probe-interval-s 5 \
    --fail-threshold 3 -- "${CLI[@]}" "${COMMON[@]}" --node-rank 1 --headless > C-watchdog.out 2>&1 & WD=$!
sleep 10; node0 C-node0-1.log; ready || exit 1; say "C: request: $(complete)"; sleep 10
kill -9 -- "-$N0"; say "C: node 0 SIGKILLed"; t0=$SECONDS
until grep -q '"event": "relaunch"' wd/events.jsonl 2>/dev/null; do
  sleep 1; (( SECONDS - t0 > 240 )) && { say "C: no relaunch of node 1 within 240 s"; exit 1; }
done
say "C: node 1 relaunched by its watchdog $((SECONDS - t0)) s later; a new node 0"
node0 C-node0-2.log; ready || exit 1; say "C: request: $(complete)"
kill -TERM "$WD"; wait "$WD"; say "C: watchdog exit code $? (143: stopped by SIGTERM)"; WD=
kill -9 -- "-$N0" 2>/dev/null; sleep 2
say "C: processes of either node left: $(ps -eo args | grep -c "[v]llm_cpu_cli.py")"
python3 - <<'PY'
import json
for line in open("wd/events.jsonl"):
    r = json.loads(line)
    if r["event"] in ("launch", "phase", "probe_fail", "wedge", "kill", "relaunch", "final"):
        print(r["ts"][11:23], r["event"], r["message"][:200])
PY
