#!/usr/bin/env bash
# The GPU checks and benchmarks on one lent H200, in one call of the device tool:
#   run(command="bash benchmarks/run_h200.sh PART", carry=[".whl"])
# PART, by purpose (each script prints a table and writes JSON; the figures go to docs/benchmarks.md
# as dated tables with their commands):
#   tests          every GPU-marked test (pytest -m gpu tests)
#   micro          one op at a time: quantize, the FP8 Linear, the optimizer step, the fused step's kernels,
#                  the compiled cast at the GPT's sites (current/delayed, amax forms)
#   train          the 125M preset trained three ways (FP8, bf16, bf16 AdamW)
#   peers          the ~1.3B GPT against the peer systems, eager
#   peers-compile  the same, fp8shard compiled in place, against torchao float8 + FSDP2
#   reference      against the compiled plain-PyTorch GPT and torchao float8, 125M and 1.3B (time-boxed)
#   profile        where a GPT step's time goes, and the Linear's and the cast's; the 125M command's
#                  step, FP8-stored weights against bf16 (its host work, its own steps profiled); the 125M
#                  micro-batch's host time, FP8-stored weights against bf16 ones
#   command        the 125M command's steps timed, FP8-stored weights against bf16, at micro-batch 8 and 16;
#                  the flat engine's gradient hook against autograd's own accumulation; the optimizer
#                  step's host and wall time against torch's fused AdamW, per-tensor and blockwise (about 6 minutes)
#   engines        the 1.3B GPT on the flat engine, the FSDP2 engine and torchao float8 + FSDP2 (world size 1)
#   memory         where the step's peak memory goes at 1.3B (against torchao float8) and at 125M: each
#                  phase's peak and what is live at the step's peak (compare_peers --memory-snapshot)
#   parity         the 125M loss-parity preset, six runs at a time, time-boxed (PARITY_BOX_S, default
#                  540 s) and resumable: repeat the same call until it prints the table (PARITY_RECIPES
#                  picks the recipes, PARITY_GPUS the runs at a time, PARITY_DATA a prepared English
#                  corpus; runs/parity_125m* stays on the machine while it is held)
#   all            every part above but parity, in that order
# Logs and JSON land in $OUT (or ./h200_out).
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
case "$part" in
  tests|micro|train|peers|peers-compile|reference|profile|command|engines|memory|parity|all) ;;
  *) echo "unknown part '$part': choose tests, micro, train, peers, peers-compile, reference, profile, command, engines, memory, parity or all" >&2
     exit 2 ;;
esac
py=python3
run() { echo "+ $*"; "$@"; echo "rc=$?"; }
want() { [ "$part" = "$1" ] || [ "$part" = all ]; }

if want tests; then
  run $py -m pytest -p no:cacheprovider -q -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
fi
if want micro; then
  run $py benchmarks/bench_quantize.py --out "$OUT/bench_quantize.json" 2>&1 | tail -15
  run $py benchmarks/bench_linear.py --out "$OUT/bench_linear.json" 2>&1 | tail -20
  run $py benchmarks/bench_optim.py --gpu --params-m 256 --out "$OUT/bench_optim_gpu.json" 2>&1 | tail -15
  run $py benchmarks/bench_fused_step.py --params-m 256 --sweep --out "$OUT/bench_fused_step.json" 2>&1 | tail -25
  run $py benchmarks/bench_compiled_cast.py --out "$OUT/bench_compiled_cast.json" 2>&1 | tail -14
fi
if want train; then
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
if want peers; then
  run $py benchmarks/compare_peers.py --gpu --out "$OUT/compare_peers_gpu.json" 2>&1 | tail -15
fi
if want peers-compile; then
  run $py benchmarks/compare_peers.py --gpu --compile --systems fp8shard-fp8,fp8shard-bf16,torchao-fsdp2 \
    --out "$OUT/compare_peers_compile.json" 2>&1 | tail -12
fi
if want reference; then
  # Under 9 minutes (REFERENCE_BUDGET_S, default 540 s): the compiled nanoGPT-style reference and
  # torchao float8 against fp8shard compiled whole (trainer.compile_scope=auto: one graph) with the chunked
  # loss, at 125M then 1.3B, then the loss head alone. Each step gets what is left of the budget
  # less what it reserves for the steps after it (a step with under 30 s is skipped and says
  # so); compare_peers rewrites its JSON after every system, so a run cut short keeps its rows.
  deadline=$((SECONDS + ${REFERENCE_BUDGET_S:-540}))
  budgeted() {  # budgeted RESERVE_S CMD...
    local left=$((deadline - SECONDS - $1)); shift
    if [ "$left" -lt 30 ]; then echo "+ skipped (budget spent): $*"; return 0; fi
    # -k: the training command ends at a step boundary on SIGTERM, and a step still compiling
    # can outlast the box (seen on the H200, 2026-12-06); KILL follows 20 s after TERM.
    run timeout -k 20 "$left" "$@"
  }
  budgeted 320 $py benchmarks/compare_peers.py --gpu --size 125m \
    --systems reference-bf16,fp8shard-fp8+compile,fp8shard-fp8+compile@all,fp8shard-bf16+compile,torchao-float8 \
    --out "$OUT/compare_reference_125m.json" > "$OUT/compare_reference_125m.log" 2>&1
  tail -9 "$OUT/compare_reference_125m.log"
  # The launch-bound 125M step: current scaling and CUDA graphs (trainer.compile_mode=reduce-overhead).
  budgeted 220 $py benchmarks/compare_peers.py --gpu --size 125m --recipe current --compile-mode reduce-overhead \
    --systems reference-bf16,fp8shard-fp8+compile,fp8shard-bf16+compile \
    --out "$OUT/compare_reference_125m_graphs.json" > "$OUT/compare_reference_125m_graphs.log" 2>&1
  tail -7 "$OUT/compare_reference_125m_graphs.log"
  budgeted 20 $py benchmarks/compare_peers.py --gpu --size 1b \
    --systems reference-bf16,fp8shard-fp8+compile,fp8shard-fp8+compile@all,torchao-float8,fp8shard-bf16+compile \
    --out "$OUT/compare_reference_1b.json" > "$OUT/compare_reference_1b.log" 2>&1
  tail -7 "$OUT/compare_reference_1b.log"
  budgeted 0 $py benchmarks/bench_loss.py --gpu --tokens 16384 --hidden 768 --vocab 50304 \
    --out "$OUT/bench_loss_125m.json" > "$OUT/bench_loss_125m.log" 2>&1
  tail -4 "$OUT/bench_loss_125m.log"
  echo "reference: ${SECONDS} s"
fi
if want profile; then
  run $py benchmarks/profile_step.py --recipe delayed --out "$OUT/profile_delayed" 2>&1 | tail -24
  run $py benchmarks/profile_step.py --systems fp8shard-fp8 --recipe current --out "$OUT/profile_current" \
    2>&1 | tail -11
  run $py benchmarks/profile_linear.py --variants "bf16,fp8 current,fp8 delayed,fp8 params" \
    --modes compile,eager --out "$OUT/profile_linear.json" 2>&1 | tail -20
  run $py benchmarks/profile_cast.py --profile --sweep --out "$OUT/profile_cast.json" 2>&1 | tail -30
  # the 125M command's micro-batch and step on the host: FP8-stored weights against bf16 ones
  run $py benchmarks/bench_host_overhead.py --gpu --profile --out "$OUT/host_overhead.json" 2>&1 | tail -34
  # the 125M command's own steps under the profiler, FP8-stored weights against bf16 ones
  run $py benchmarks/profile_command.py --set trainer.accelerator=gpu --out "$OUT/profile_command.json" \
    2>&1 | tail -60
fi
if want command; then
  # The 125M command's steps timed (FP8-stored weights against bf16), at the preset's micro-batch
  # and at 16 (the step is bound by the host there), and the gradient hook's host cost.
  for mbs in 8 16; do
    run $py benchmarks/profile_command.py --no-profile --steps 8 --set trainer.accelerator=gpu \
      model.micro_batch_size=$mbs --out "$OUT/command_mbs$mbs.json" 2>&1 | grep -v Warn | tail -9
  done
  run $py benchmarks/bench_grad_hooks.py --device cuda --out "$OUT/grad_hooks.json" 2>&1 | tail -5
  for recipe in current blockwise; do  # blockwise: the reference step kernel (tiled scales)
    run $py benchmarks/bench_step_host.py --gpu --recipe $recipe --out "$OUT/step_host_$recipe.json" 2>&1 | tail -6
  done
fi
if want engines; then
  # Issue 18: the FSDP2 engine within 5% of the flat engine, and against torchao float8 + FSDP2
  # (blocks compiled, FP8 all-gather); every system eager but torchao's blocks.
  run $py benchmarks/compare_peers.py --gpu --size 1b --recipe current \
    --systems fp8shard-fp8,fp8shard-fsdp2,torchao-fsdp2 --out "$OUT/compare_engines_1b.json" 2>&1 | tail -9
fi
if want memory; then
  # Issue 16: the 1.3B peak against torchao's, and the 125M peak (docs/performance.md, section 11).
  # A cold machine compiles the 1.3B systems for minutes: give this part at least 420 s.
  run $py benchmarks/compare_peers.py --gpu --size 1b --recipe current --memory-snapshot \
    --systems reference-bf16,fp8shard-fp8+compile,torchao-float8 --out "$OUT/memory_1b.json" 2>&1 | tail -45
  run $py benchmarks/compare_peers.py --gpu --size 125m --recipe current --memory-snapshot \
    --systems reference-bf16,fp8shard-fp8+compile,fp8shard-bf16+compile --out "$OUT/memory_125m.json" 2>&1 | tail -45
fi
if [ "$part" = parity ]; then
  # Issue 17 on the GPU: bf16 against the FP8 recipes, 3 seeds, 1000 steps of GPT-2 small
  # (docs/numerics.md). SIGTERM stops the benchmark cleanly, keeping each run's checkpoints; the
  # next call with --reuse reads the finished runs and resumes the others.
  # PARITY_DATA: a prepared English corpus carried along (carry=["data/english-bpe"], made by
  # benchmarks/english_corpus.sh and `python -m fp8shard.data prepare`, docs/numerics.md);
  # PARITY_GPUS: runs at a time (six on GPU 0 by default: each peaks near 10 GB at 125M; six
  # ran on one H100's 80 GB, 2026-12-08, where nine do not fit).
  pout=runs/parity_125m${PARITY_DATA:+_$(basename "$PARITY_DATA")}
  run timeout -k 30 -s TERM "${PARITY_BOX_S:-540}" $py benchmarks/parity.py --preset h200-125m \
    --recipes "${PARITY_RECIPES:-bf16,fp8-current,fp8-delayed,fp8-rowwise,fp8-blockwise}" \
    --gpus "${PARITY_GPUS:-0,0,0,0,0,0}" ${PARITY_DATA:+--data "$PARITY_DATA"} --out "$pout" --reuse 2>&1 | tail -20
  cp "$pout/parity.json" "$pout/parity.png" "$OUT/" 2>/dev/null || true
fi
