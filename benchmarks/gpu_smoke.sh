#!/usr/bin/env bash
# The GPU checks of ludic in one script, for a machine with an NVIDIA GPU (a lent device
# machine, or your own). From the repository root:
#
#     bash benchmarks/gpu_smoke.sh            # PYTHON=python3 and OUT=/tmp/gpu_smoke by default
#
# 1. The GPU tests: CUDA IPC between processes, NCCL broadcast (two GPUs), the bf16 packed
#    and checkpointed training step, the FSDP2 trainer on NCCL (two GPUs, and a group of
#    one on one GPU: the sharded learner's path, checkpointed and resumed), the colocated
#    vLLM server (CUDA IPC syncs verified and to parity, an adapter-only LoRA sync over
#    packed CUDA IPC, sleep/wake) and a reward server's sleep and wake (weights kept, and
#    reloaded from disk). Each that cannot run says why (-rs).
# 2. benchmarks/gpu_sync.py: a Qwen2.5-0.5B-shaped bf16 policy synced by packed and
#    per-tensor CUDA IPC, NCCL (two GPUs) and into a real vLLM server (goal <= 0.1 s);
#    benchmarks/lora_sync.py --cuda: that shape's LoRA policy, adapter-only against merged.
# 3. Short runs of examples/configs/gsm8k_qwen2.5_0.5b_vllm.yaml and its LoRA variant on a
#    locally built model of that shape and a few generated GSM8K-format problems (nothing
#    is downloaded): the colocated path end to end (vLLM on the trainer's GPU, packed CUDA
#    IPC, sleep/wake; the LoRA run publishes the adapter alone).
#
# Steps 1's vLLM tests, 2's vLLM row and 3 need vLLM's GPU build (pip install
# 'ludic-rl[vllm]'); where it is missing they are skipped and say so. Everything printed is
# also in $OUT/gpu_smoke.log; record the figures in benchmarks/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_smoke}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu_smoke.log") 2>&1
status=0

echo "== machine"
nvidia-smi -L || { echo "no NVIDIA GPU: nothing to check"; exit 1; }
$PYTHON -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
has_vllm=$($PYTHON -c "import vllm" 2>/dev/null && echo yes || echo no)
echo "vLLM installed: $has_vllm"

echo "== 1. GPU tests"
$PYTHON -m pytest -q -rs -p no:cacheprovider \
    tests/distributed/test_weight_transfer_cuda.py \
    tests/training/test_train_step_gpu.py \
    tests/distributed/test_fsdp_trainer.py \
    tests/vllm/test_vllm_colocated.py \
    tests/vllm_reward/test_reward_sleep.py \
    -k "cuda or nccl or gpu or bf16 or flash or colocated or sleep" || status=1

echo "== 2. weight sync of a 0.5B-shaped policy"
$PYTHON benchmarks/gpu_sync.py --repeats 5 || status=1
if [ "$has_vllm" = yes ]; then  # adapter-only against merged LoRA syncs, both verified
    $PYTHON benchmarks/lora_sync.py --cuda --rounds 3 || status=1
else
    echo "lora_sync.py skipped: vLLM is not installed here"
fi

echo "== 3. a short GSM8K recipe run (colocated vLLM)"
if [ "$has_vllm" = yes ]; then
    work="$OUT/recipe"
    rm -rf "$work" && mkdir -p "$work"
    $PYTHON benchmarks/gpu_sync.py --save-model "$work/model" >/dev/null || status=1
    $PYTHON - "$work" <<'PY' || status=1
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
for name, n, offset in (("train", 64, 0), ("test", 16, 600)):
    rows = [
        {"question": f"Tom has {i} apples and buys {i + 2} more. How many does he have?",
         "answer": f"He has {2 * i + 2} apples.\n#### {2 * i + 2}"}
        for i in range(offset, offset + n)
    ]
    (work / f"gsm8k_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
PY
    # the full-weight recipe, then the LoRA one (the adapter alone, packed CUDA IPC)
    for recipe in gsm8k_qwen2.5_0.5b_vllm gsm8k_qwen2.5_0.5b_lora_vllm; do
        started=$(date +%s)
        $PYTHON -m ludic train "examples/configs/$recipe.yaml" \
            "model.path=$work/model" "env.kwargs.path=$work/gsm8k_train.jsonl" \
            "env.eval_kwargs.path=$work/gsm8k_test.jsonl" "output_dir=$work/runs_$recipe" \
            trainer.steps=3 trainer.prompts_per_step=4 trainer.warmup_steps=0 \
            algorithm.group_size=4 sampling.max_tokens=64 eval.num_problems=8 eval.every=0 \
            trainer.checkpoint_every=100 logging.console_every=1 || status=1
        echo "$recipe run: $(( $(date +%s) - started )) s"
    done
else
    echo "skipped: vLLM is not installed here (pip install 'ludic-rl[vllm]')"
fi

echo "== done (status $status); log: $OUT/gpu_smoke.log"
exit $status
