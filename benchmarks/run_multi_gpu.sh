#!/usr/bin/env bash
# The several-GPU checks of issue 10, for a device kind with 2-8 H200s, in one call:
#   run(kind="nvidia-h200-x4", command="bash benchmarks/run_multi_gpu.sh all")
# PART: tests | comm | resume | fsdp2 | all. Logs and JSON land in $OUT (or ./multi_gpu_out).
# Not yet run: no kind with several GPUs has been lent (the CPU twins of each part run in CI:
# gloo DistPool tests, tests/bench/test_bench_collectives.py, tests/checkpoint resharding).
set -uo pipefail
OUT="${OUT:-$PWD/multi_gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
# NVLink multicast off (the device README: it is not supported on the lent machines).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=python3
ngpu=$($py -c "import torch; print(torch.cuda.device_count())")
part="${1:-all}"
run() { echo "+ $*"; "$@"; echo "rc=$?"; }
echo "GPUs: $ngpu"

if [ "$part" = tests ] || [ "$part" = all ]; then
  # The multi-process suites: DistPool picks NCCL (one GPU per rank) for every world size up to
  # the GPU count, gloo above it.
  run $py -m pytest -p no:cacheprovider -q tests/optim tests/checkpoint tests/fp8/test_collectives.py tests/fsdp2 \
    2>&1 | tee "$OUT/pytest_multi_gpu.log" | tail -15
fi
if [ "$part" = comm ] || [ "$part" = all ]; then
  # FP8 against bf16 parameter all-gather (and the bf16 gradient reduce-scatter), per bucket size.
  w=2
  while [ "$w" -le "$ngpu" ]; do
    run $py -m torch.distributed.run --standalone --nproc-per-node "$w" benchmarks/bench_collectives.py \
      --sizes-m 0.25,1,4,16,64,256 --out "$OUT/bench_collectives_ws$w.json" 2>&1 | tail -9
    w=$((w * 2))
  done
fi
if [ "$part" = resume ] || [ "$part" = all ]; then
  # A checkpoint written at 4 GPUs (or all there are) resumed at 2, then on CPU over gloo.
  big=$(( ngpu < 4 ? ngpu : 4 ))
  common="config=gpt_125m exp_manager.exp_dir=$OUT/runs exp_manager.name=resume checkpoint.every_n_steps=20"
  run $py -m torch.distributed.run --standalone --nproc-per-node "$big" -m fp8shard.train $common \
    trainer.accelerator=gpu trainer.max_steps=20 2>&1 | tail -4
  run $py -m torch.distributed.run --standalone --nproc-per-node 2 -m fp8shard.train $common \
    trainer.accelerator=gpu trainer.max_steps=40 2>&1 | grep -E "resumed|error|final" | head -5
  run $py -m torch.distributed.run --standalone --nproc-per-node 2 -m fp8shard.train $common \
    trainer.accelerator=cpu trainer.max_steps=41 2>&1 | grep -E "resumed|error|final" | head -5
fi
if [ "$part" = fsdp2 ] || [ "$part" = all ]; then
  # The FSDP2 engine against the flat engine on NCCL (one GPU per rank): losses, gathered bytes
  # per FP8 weight, persistent memory, step time; HSDP (2 replicas) where there are 4+ GPUs.
  run $py -m torch.distributed.run --standalone --nproc-per-node "$ngpu" benchmarks/bench_fsdp2.py \
    --out "$OUT/bench_fsdp2_ws$ngpu.json" 2>&1 | tail -12
  if [ "$ngpu" -ge 4 ]; then
    run $py -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/bench_fsdp2.py --replicate 2 \
      --out "$OUT/bench_fsdp2_hsdp.json" 2>&1 | tail -12
  fi
  # The training command on FSDP2 at every GPU, resumed on the flat engine at 2.
  common="config=gpt_125m exp_manager.exp_dir=$OUT/runs exp_manager.name=fsdp2 checkpoint.every_n_steps=20"
  run $py -m torch.distributed.run --standalone --nproc-per-node "$ngpu" -m fp8shard.train $common \
    trainer.accelerator=gpu trainer.strategy=fsdp2 trainer.max_steps=20 2>&1 | tail -4
  run $py -m torch.distributed.run --standalone --nproc-per-node 2 -m fp8shard.train $common \
    trainer.accelerator=gpu trainer.max_steps=40 2>&1 | grep -E "resumed|error|final" | head -5
fi
