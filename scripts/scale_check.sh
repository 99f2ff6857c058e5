#!/usr/bin/env bash
# Issue 24 item 6 at full size, on a machine with cores to spare (the lent GPU machine: 16): the real
# supervisor against simulated node agents (bench/scale_load.py), at 1 s steps, with relays
# (ops/node/relay.py) and without, side by side where the time allows; one device call:
#   here:  bash scripts/gpu_wheels.sh      (.whl/: pydantic & co. for the image's python)
#   there: run(command="bash scripts/scale_check.sh", carry=[".whl"], timeout_s=590)
# With --template and --relay-tier the relays of rank 0's and the victim's groups are real processes and
# every other group one link sending the relay's own bytes (bench/README.md, "Templated relays"): 131,072
# ranks then need ~2 cores besides the supervisor's, not 256 relay processes.
# Runs in order of what they tell, each only if the time left (SCALE_CHECK_BUDGET, 560 s) holds it:
# 131,072 ranks through relays; 16,384 ranks (a whole node silent) through relays, then without;
# 1,024 ranks both ways; 16,384 through relays with the supervisor starved to half a core.
# Each run's JSON (the keys of bench/scale_load.py: ranks, cpu_pct_of_one_core, rss_mb_max, hang.*)
# and its log go to $OUT (or /tmp/scale-check); bench/README.md says what came back.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${SCALE_CHECK_BUDGET:-560}
OUTD=${OUT:-/tmp/scale-check}
mkdir -p "$OUTD"
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null
if compgen -G ".whl/*.whl" >/dev/null; then
  line=$(bash scripts/gpu_check.sh --install-only | tail -1)
  case "$line" in export\ *) eval "$line" ;; *) echo "scale_check: install failed: $line"; exit 2 ;; esac
fi
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" -c 'import ptops.ops.node.relay' || { echo "scale_check: ptops does not import"; exit 2; }
echo "scale_check: $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB, python $("$PY" -V 2>&1), ulimit -n $(ulimit -n)"
SUM=(--set supervisor.node_summaries=true --set supervisor.metrics_lines=node
     --set supervisor.metrics_rank_detail_every=60
     --set supervisor.health.enabled=false)  # simulated ranks: no GPU of this host is theirs
run() {  # NAME NEED_S TIMEOUT_S ARGS...: one size, if NEED_S is left
  local name=$1 need=$2 tmo=$3; shift 3
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt "$need" ]; then echo "scale_check: $name skipped ($left s left, needs $need)"; return; fi
  echo "scale_check: $name (timeout $tmo s, $left s left) at $(date -u +%T)"
  rm -rf "/tmp/scale-$name"
  timeout -k 10 $((tmo + 60)) "$PY" bench/scale_load.py "$@" --timeout "$tmo" --work "/tmp/scale-$name" \
    --json "$OUTD/$name.json" > "$OUTD/$name.log" 2>&1
  echo "scale_check: $name rc=$? $(tail -c 300 "$OUTD/$name.log" | tr '\n' ' ' | cut -c1-200)"
  "$PY" - "$OUTD/$name.json" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(print("  no result"))
keys = ("ranks", "relay_tier", "cpu_pct_of_one_core", "main_thread_cpu_pct", "channel_thread_cpu_pct",
        "relays_cpu_pct", "rss_mb_max", "inbox_max", "record_latency_s", "generator_late_max_s", "no_steady_state")
print("  " + json.dumps({k: d[k] for k in keys if k in d}))
h = d.get("hang") or {}
print("  hang: " + json.dumps({k: h.get(k) for k in ("found_ranks", "found_exactly_the_silent", "detect_s", "budget_s", "stacks_s", "also_quiet_count")}))
EOF
}
T=(--template --step-s 1 --gen-procs 4)
run r131072-relay64 250 260 --ranks 131072 "${T[@]}" --steady 60 --relay-tier 64 "${SUM[@]}"
run r16384-node-relay64 100 110 --ranks 16384 "${T[@]}" --steady 30 --silent node --relay-tier 64 "${SUM[@]}"
run r16384-node-agents 100 110 --ranks 16384 "${T[@]}" --steady 30 --silent node --relay-tier 0 "${SUM[@]}"
run r1024-relay16 50 60 --ranks 1024 --step-s 1 --gen-procs 2 --steady 20 --relay-tier 16 "${SUM[@]}"
run r1024-agents 50 60 --ranks 1024 --step-s 1 --gen-procs 2 --steady 20 --relay-tier 0 "${SUM[@]}"
run r16384-starved-relay64 100 110 --ranks 16384 "${T[@]}" --steady 30 --starve --relay-tier 64 "${SUM[@]}"
echo "scale_check: done in $SECONDS s"
