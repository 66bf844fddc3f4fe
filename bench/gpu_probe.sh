#!/usr/bin/env bash
# The session's GPU probe: bench/gpu_probe.py items in order of value, each in its own process under a
# timeout capped by one overall deadline, rows appended to $OUT/rows.jsonl as measured (nothing lost on a kill).
#   bash bench/gpu_probe.sh [DEADLINE_S] [--tiny]
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE=${1:-540}
TINY=${2:-}
OUT=${OUT:-/tmp/gpu_probe}
mkdir -p "$OUT"
export PROBE_ROWS=$OUT/rows.jsonl PROBE_DIR=$OUT PYTHONUNBUFFERED=1
export VIT_FAST_CACHE_DIR=${VIT_FAST_CACHE_DIR:-/tmp/vit_fast_cache}
start=$SECONDS

item() {  # item NAME MAX_S ARGS...: run unless the deadline is near; a hang dumps its stack at 2/3 of its time
  local name=$1 max=$2; shift 2
  local left=$((DEADLINE - (SECONDS - start) - 5))
  local t=$((max < left ? max : left))
  if ((t < 15)); then echo "[probe] SKIPPED $name (deadline)"; echo "{\"item\":\"skipped\",\"name\":\"$name\"}" >>"$PROBE_ROWS"; return; fi
  echo "[probe $((SECONDS - start)) s] $name (timeout $t s)"
  timeout -k 5 "$t" python3 bench/gpu_probe.py "$@" $TINY --dump-after $((t * 2 / 3))
  local rc=$?
  echo "[probe $((SECONDS - start)) s] $name rc=$rc"
  ((rc == 0)) || echo "{\"item\":\"failed\",\"name\":\"$name\",\"rc\":$rc}" >>"$PROBE_ROWS"
}

item env 40 env
# The compile hang, with lazy autotuning on and off, side by side (CPU-bound compiles; nothing else timed meanwhile).
(VIT_FAST_AUTOTUNE=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 item hang-autotune1 70 hang --batch 8 >"$OUT/hang1.log" 2>&1) &
(VIT_FAST_AUTOTUNE=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ind0 item hang-autotune0 70 hang --batch 8 >"$OUT/hang0.log" 2>&1) &
wait
grep -h "ROW\|rc=" "$OUT"/hang?.log
for preset in vit_small_patch16_224 vit_base_patch16_224; do
  for path in timm_eager vit_fast vit_fast_short timm_graph vit_fast_graph; do
    item "step $preset $path" 60 step --preset $preset --path $path
  done
done
item attn 75 attn
item micro 90 micro
item gemm 30 gemm
VIT_FAST_AUTOTUNE=0 item "step vit_fast_compile B/16" 120 step --preset vit_base_patch16_224 --path vit_fast_compile
item "step timm_compile B/16" 90 step --preset vit_base_patch16_224 --path timm_compile
item "step timm_compile S/16" 90 step --preset vit_small_patch16_224 --path timm_compile
echo "[probe] done in $((SECONDS - start)) s"
python3 - "$PROBE_ROWS" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                   if k not in ("torch", "triton", "timm", "git", "date")))
EOF
