#!/usr/bin/env bash
# One leased GPU call, in order of value, each step under a timeout capped by one overall deadline; everything
# lands under $OUT (results.tar.gz + log). Run on the device machine from the repository root:
#   set -o pipefail; bash bench/gpu_session.sh 520 2>&1 | tee $OUT/log
# A second call issued at once (the machine still warm) spends the rest of the lease on the steps the first could
# not reach, from the named one on:
#   set -o pipefail; FROM=attn bash bench/gpu_session.sh 200 2>&1 | tee $OUT/log
set -uo pipefail
DEADLINE=${1:-520}
FROM=${FROM:-}
OUT=${OUT:-/tmp/gpu_session}
R=$OUT/results
mkdir -p "$R"
export PROBE_ROWS=$R/rows.jsonl PROBE_DIR=$R PYTHONUNBUFFERED=1
export VIT_FAST_CACHE_DIR=${VIT_FAST_CACHE_DIR:-/tmp/vit_fast_cache}
start=$SECONDS
pack() {  # the autotune cache too: every timed candidate lands there as it is measured, a killed tune's included
  rm -rf "$R/autotune_cache"; cp -r "$VIT_FAST_CACHE_DIR" "$R/autotune_cache" 2>/dev/null
  tar -czf "$OUT/results.tar.gz" -C "$OUT" results 2>/dev/null
}
step() {  # step NAME MAX_S CMD...: run unless the deadline is near or FROM names a later step
  local name=$1 max=$2; shift 2
  if [[ -n $FROM && $name != "$FROM" ]]; then echo "[session] not run: $name (FROM=$FROM)"; return; fi
  FROM=
  local left=$((DEADLINE - (SECONDS - start) - 10))
  local t=$((max < left ? max : left))
  if ((t < 15)); then echo "[session] SKIPPED $name (deadline)"; return; fi
  echo "[session $((SECONDS - start)) s] $name (timeout $t s)"
  timeout -k 5 "$t" "$@"
  echo "[session $((SECONDS - start)) s] $name rc=$?"
  pack
}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "Running pip as"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout, whichever interpreter pip installed into
python3 -c "import torch, triton, vit_fast; print(torch.__version__, triton.__version__, vit_fast.__file__)"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
# the headline (ViT-B/16 and S/16 b256: timm eager / compile, vit_fast eager / compile / CUDA graph, profile) first
step campaign 300 python3 -c "import sys; from vit_fast.tools.cli import main; sys.exit(main())" bench --campaign --quick --out "$R/campaign"
# what only a GPU checks (8 workers; each failure's traceback printed as it happens, which a deadline cannot lose):
# the activations with the GPU's approximate exp2, the TMA kernels and every sm_90 attention
# candidate against float64, graph replays draw fresh dropout masks, a block as one autograd Function bitwise its
# parts on the compiled kernels, the short kernels
VIT_FAST_FAILURES_AT_ONCE=1 step tests 120 python3 -m pytest -q -n 8 tests/test_math.py tests/test_linear_act_tma.py "tests/test_attention.py::test_every_sm90_candidate_matches_float64" "tests/test_attention.py::test_stored_ds_backward_matches_float64" tests/test_graphs.py tests/test_fused_block.py tests/test_attention_short.py -p no:cacheprovider
# the host work at ViT-S/16 eager batch 1, where the GPU work is a small part of the step, which is then about the
# host's time per step: vit_fast and timm eager, and vit_fast with every launch through Triton's JIT
# (VIT_FAST_DIRECT_LAUNCH=0: what the direct launches of _tuning.KernelLaunch save), each with its cProfile table
# (hostprof_*.txt: where a GPU host's time goes, which the CPU meter `vit-fast host` can only approximate)
step host 75 bash -c 'for p in vit_fast timm_eager; do python3 bench/gpu_probe.py hostprof --preset vit_small_patch16_224 --path $p --batch 1 --dump-after 30; done; VIT_FAST_DIRECT_LAUNCH=0 python3 bench/gpu_probe.py hostprof --preset vit_small_patch16_224 --path vit_fast --batch 1 --dump-after 30'
# attention from packed qkv to its gradient per shape (issue 32): vit_fast's flash kernels, the stored-dS backward
# (an autotuning candidate never timed on a GPU), the short family, SDPA's backends; CUDA-graph ms
step attn 60 python3 bench/gpu_probe.py attn --dump-after 40
# issue 30's batch-64 target where host work weighs most: ViT-S/16 b64 under torch.compile, timm's and vit_fast's
# (the quick campaign measures batch 256 only), each row in its own process with the campaign's hang diagnosis
step b64 120 python3 -c "import sys; from vit_fast.tools.cli import main; sys.exit(main())" bench --campaign --stages throughput --models vit_small_patch16_224 --batches 64 --paths timm_compile vit_fast_compile --budget 230 --out "$R/b64"
# every part's candidates timed on ViT-B/16 b256, as JSON
step tune 100 python3 -c "import sys; from vit_fast.tools.cli import main; sys.exit(main())" tune --model vit_base_patch16_224 --batch 256 --json "$R/tune_b16_b256.json"
# the fused ops alone, kernel time (CUDA-graph replays) beside host-included calls: the full campaign's micro stage
step micro 100 python3 -c "import sys; from vit_fast.tools.cli import main; sys.exit(main())" bench --campaign --stages micro --budget 100 --out "$R/micro"
# linear_act's Triton GEMMs, pointer vs persistent TMA kernels (never run on a GPU before), against cuBLAS
step gemm 60 python3 bench/gpu_probe.py gemm --dump-after 50
# host microseconds per launch: the op (its launches direct since _tuning.KernelLaunch), Triton's JIT launch and the
# compiled kernel called directly (behind a fake sm_90 driver on the 2-core CPU machine, triton 3.8.0, 2026-11-28:
# JIT about 10 us, KernelLaunch's direct call 4-5, a CPU check, not a GPU timing)
step launch 30 python3 bench/gpu_probe.py launch --dump-after 20
# linear_act's TMA kernels (sm_90's default since 2026-11-27) against its pointer kernels in a whole ViT-B/16 step
VIT_FAST_TMA_GEMM=0 step tma_off 45 python3 -c "import sys; from vit_fast.tools.cli import main; sys.exit(main())" bench --models vit_base_patch16_224 --batches 256 --paths vit_fast --steps 20 --warmup 5 --out "$R/tma_off"
step trace 45 python3 bench/gpu_probe.py trace --path vit_fast --dump-after 30
echo "[session] done in $((SECONDS - start)) s"
pack
