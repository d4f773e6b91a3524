#!/usr/bin/env bash
# Everything this project proves on the lent H200, in one call of the device tool:
#   run(command="bash benchmarks/run_h200.sh PART", carry=[".whl"])
# PART: tests | micro | train | peers | speed | all, or round2a / round2b / final / peers16 (one round's checks). Logs and JSON land in $OUT (or ./h200_out).
set -uo pipefail
OUT="${OUT:-$PWD/h200_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # torchao, carried as a wheel (no network there)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
part="${1:-all}"
py=python3
run() { echo "+ $*"; "$@"; echo "rc=$?"; }

if [ "$part" = tests ] || [ "$part" = all ]; then
  run $py -m pytest -p no:cacheprovider -q -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
fi
if [ "$part" = micro ] || [ "$part" = all ]; then
  run $py benchmarks/bench_quantize.py --out "$OUT/bench_quantize.json" 2>&1 | tail -15
  run $py benchmarks/bench_linear.py --out "$OUT/bench_linear.json" 2>&1 | tail -20
  run $py benchmarks/bench_optim.py --gpu --params-m 256 --out "$OUT/bench_optim_gpu.json" 2>&1 | tail -15
fi
if [ "$part" = train ] || [ "$part" = all ]; then
  # The 125M preset on one GPU: FP8 params + DistributedFusedAdam vs bf16 (ours) vs bf16 AdamW.
  steps="${TRAIN_STEPS:-200}"
  for v in "fp8 " "bf16 model.fp8=false model.fp8_params=false" \
           "adamw model.fp8=false model.fp8_params=false model.optim.name=adamw"; do
    set -- $v; name=$1; shift
    run $py -m fp8shard.train config=gpt_125m trainer.accelerator=gpu trainer.max_steps=$steps \
      exp_manager.exp_dir="$OUT/runs" exp_manager.name=gpt125m_$name "$@" 2>&1 | tail -9
  done
  run $py -m fp8shard.report "$OUT/runs/gpt125m_fp8" "$OUT/runs/gpt125m_bf16" "$OUT/runs/gpt125m_adamw" \
    --out "$OUT/runs/plots" 2>&1 | tail -3
  for n in fp8 bf16 adamw; do cp "$OUT/runs/gpt125m_$n/summary.json" "$OUT/summary_125m_$n.json"; done
fi
if [ "$part" = peers ] || [ "$part" = all ]; then
  run $py benchmarks/compare_peers.py --gpu --out "$OUT/compare_peers_gpu.json" 2>&1 | tail -15
fi
if [ "$part" = speed ] || [ "$part" = all ]; then
  # Issue 8 after the fused kernels: the fused Adam step checked and timed (it is opt-in until
  # this has run), the 1.3B step re-profiled, eager vs compiled against torchao, the Linear.
  run $py benchmarks/smoke_triton_adam.py --params-m 256 --sweep --out "$OUT/smoke_triton_adam.json" 2>&1 | tail -25
  run $py benchmarks/profile_step.py --out "$OUT/profile_after" 2>&1 | tail -30
  FP8SHARD_FUSED_ADAM=1 run $py benchmarks/profile_step.py --systems fp8shard-fp8 --out "$OUT/profile_after_fused_adam" 2>&1 | tail -15
  run $py benchmarks/compare_peers.py --gpu --compile --systems fp8shard-fp8,fp8shard-bf16,torchao-fsdp2 \
    --out "$OUT/compare_peers_compile.json" 2>&1 | tail -12
  run $py benchmarks/profile_linear.py --variants "bf16,fp8 current,fp8 delayed,fp8 params" \
    --modes compile,eager 2>&1 | tail -20
fi
if [ "$part" = round2a ]; then
  # The bias epilogue, the batched scale update and the fused Adam default, checked and timed.
  run $py -m pytest -p no:cacheprovider -q -m gpu tests/nn tests/optim/test_fused_step.py 2>&1 \
    | tee "$OUT/pytest_gpu_round2.log" | tail -6
  run $py benchmarks/smoke_triton_adam.py --params-m 256 --out "$OUT/smoke_triton_adam.json" 2>&1 | tail -14
  run $py benchmarks/bench_linear.py --out "$OUT/bench_linear.json" 2>&1 | tail -24
fi
if [ "$part" = round2b ]; then
  run $py benchmarks/compare_peers.py --gpu --compile --systems fp8shard-fp8,fp8shard-bf16,torchao-fsdp2 \
    --out "$OUT/compare_peers_compile.json" 2>&1 | tail -9
  run $py benchmarks/profile_step.py --recipe delayed --out "$OUT/profile_delayed" 2>&1 | tail -24
  run $py benchmarks/profile_step.py --systems fp8shard-fp8 --recipe current --out "$OUT/profile_current" 2>&1 | tail -11
fi
if [ "$part" = final ]; then  # every GPU test, then the GPT step re-profiled (both recipes' default)
  run $py -m pytest -p no:cacheprovider -q -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -4
  run $py benchmarks/profile_step.py --recipe delayed --out "$OUT/profile_final" 2>&1 | tail -22
fi
if [ "$part" = peers16 ]; then
  # Issue 16, in one call of under ~8 minutes (PEERS16_BUDGET_S, default 510 s): the compiled
  # nanoGPT-style reference and torchao float8 against fp8shard compiled whole
  # (trainer.compile_scope=model) with the chunked loss, at 125M then 1.3B; the GPU tests of the
  # new paths; the loss head alone; a 125M profile. Each step gets what is left of the budget
  # less what it reserves for the steps after it (a step with under 30 s is skipped and says
  # so); compare_peers rewrites its JSON after every system, so a run cut short keeps its rows.
  deadline=$((SECONDS + ${PEERS16_BUDGET_S:-510}))
  budgeted() {  # budgeted RESERVE_S CMD...
    local left=$((deadline - SECONDS - $1)); shift
    if [ "$left" -lt 30 ]; then echo "+ skipped (budget spent): $*"; return 0; fi
    run timeout "$left" "$@"
  }
  budgeted 240 $py benchmarks/compare_peers.py --gpu --compile --size 125m \
    --systems reference-bf16,fp8shard-fp8,fp8shard-bf16,torchao-float8 \
    --out "$OUT/compare_peers16_125m.json" > "$OUT/compare_peers16_125m.log" 2>&1
  tail -9 "$OUT/compare_peers16_125m.log"
  # 1.3B: compiled rows only (the eager fp8shard rows are in docs/benchmarks.md, 2026-12-04).
  budgeted 120 $py benchmarks/compare_peers.py --gpu --size 1b \
    --systems reference-bf16,fp8shard-fp8+compile,torchao-float8,fp8shard-bf16+compile \
    --out "$OUT/compare_peers16_1b.json" > "$OUT/compare_peers16_1b.log" 2>&1
  tail -7 "$OUT/compare_peers16_1b.log"
  budgeted 0 $py -m pytest -p no:cacheprovider -q -m gpu tests/train/test_loss.py \
    tests/train/test_compile_scope.py > "$OUT/pytest_gpu_peers16.log" 2>&1
  tail -6 "$OUT/pytest_gpu_peers16.log"
  budgeted 0 $py benchmarks/bench_loss.py --gpu --tokens 16384 --hidden 768 --vocab 50304 \
    --out "$OUT/bench_loss_125m.json" > "$OUT/bench_loss_125m.log" 2>&1
  tail -4 "$OUT/bench_loss_125m.log"
  budgeted 0 $py benchmarks/profile_step.py --size 125m --systems fp8shard-fp8+compile,reference-bf16 \
    --out "$OUT/profile16_125m" > "$OUT/profile16_125m.log" 2>&1
  tail -26 "$OUT/profile16_125m.log"
  echo "peers16: ${SECONDS} s"
fi
