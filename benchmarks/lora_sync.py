"""Adapter-only LoRA syncs against merged ones: a peft LoRA policy of Qwen2.5-0.5B's shape
(random weights, built here; float32, as vLLM's CPU defaults serve it; the GSM8K LoRA
recipe's adapter: rank 16, alpha 32, every attention and MLP projection) published into
one real vLLM CPU server started with ``--lora-rank 16``, as ``ludic train`` does it:
``model.lora.sync: adapter`` (the default) against ``merged``, interleaved, verified
(``verify_sync: every``, the default) both.

    .venv/bin/python benchmarks/lora_sync.py [--rounds 3] [--model qwen0.5b|tiny] [--cuda]

Each sync is timed from the trainer's extraction (``adapter_state_dict`` /
``policy_state_dict``, which merges ``W + BA``) to the verified report. It prints the bytes
each moves, the median seconds of each, and the median (and range) over rounds of
merged / adapter within a round. The trainer (this process, one thread) is pinned to core
0 and the server to core 1 (``--cores``); nothing else should run. ``--cuda``: both on
this GPU, synced by packed CUDA IPC (``gpu_smoke.sh``; written, never run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from sync_verify import save_qwen05_shape

from ludic.distributed.weights import adapter_config, adapter_state_dict, policy_state_dict
from ludic.inference.vllm.client import VLLMChatClient
from ludic.inference.vllm.process import start_vllm_server
from ludic.models.tiny import save_tiny_model

RANK, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure(model_dir: Path, rounds: int, log: Path, server_cores: str, cuda: bool) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ludic.distributed.weight_transfer import create_strategy

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if cuda:
        base = base.to("cuda")
    policy = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    with torch.no_grad():  # a trained adapter: B != 0
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    published = {"adapter": adapter_state_dict, "merged": policy_state_dict}
    extra = ["--lora-rank", str(RANK)]
    if cuda:  # on the trainer's GPU: float32 as the trainer, a share of the memory
        extra += ["--dtype", "float32", "--gpu-memory-utilization", "0.3"]
    with start_vllm_server(
        model_dir,
        api_key="bench",
        log_path=log,
        cpu=not cuda,
        cpu_cores=None if cuda else server_cores,
        extra_args=extra,
    ) as server:
        client = VLLMChatClient(server.url, api_key="bench", timeout_s=600.0)
        if cuda:  # one GPU: NCCL cannot join two ranks on it
            client.init_weight_sync(strategy=create_strategy("packed_cuda_ipc"))
        else:
            client.init_weight_sync(master_port=server.group_port)
        client.set_lora_adapter(adapter_config(policy))
        times: dict[str, list[float]] = {"adapter": [], "merged": []}
        nbytes: dict[str, int] = {}
        version = 0
        for r in range(rounds + 1):  # round 0 warms up both paths
            for mode in ("adapter", "merged") if r % 2 else ("merged", "adapter"):
                version += 1
                started = time.perf_counter()
                state = published[mode](policy)
                client.sync_weights(state, version=version)
                seconds = time.perf_counter() - started
                nbytes[mode] = sum(t.numel() * t.element_size() for t in state.values())
                assert client.weight_sync.verified == version, "a sync was not verified"
                if r:
                    times[mode].append(seconds)
        client.close()
    paired = [m / a for m, a in zip(times["merged"], times["adapter"])]  # same round
    return {
        "adapter": statistics.median(times["adapter"]),
        "merged": statistics.median(times["merged"]),
        "paired": statistics.median(paired),
        "paired_range": (min(paired), max(paired)),
        "bytes": nbytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="qwen0.5b", choices=["qwen0.5b", "tiny"])
    parser.add_argument("--cores", default="0,1", help="trainer core, server core(s)")
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="trainer and server on this GPU, synced by packed CUDA IPC (no core pinning)",
    )
    args = parser.parse_args()
    trainer_core, server_cores = args.cores.split(",", 1)
    if not args.cuda:
        os.sched_setaffinity(0, {int(trainer_core)})
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.model == "tiny":
            model_dir = save_tiny_model(root / "tiny")
        else:
            model_dir = save_qwen05_shape(root / "qwen0.5b")
        m = measure(model_dir, args.rounds, root / "server.log", server_cores, args.cuda)
    low, high = m["paired_range"]
    print(
        f"{args.model}{' (cuda, packed_cuda_ipc)' if args.cuda else ''}: adapter {m['bytes']['adapter'] / 2**20:.1f} MiB in "
        f"{m['adapter']:.3f} s, merged {m['bytes']['merged'] / 2**20:.0f} MiB in "
        f"{m['merged']:.3f} s (medians of {args.rounds}, verified); merged / adapter within "
        f"a round: median {m['paired']:.1f}x (from {low:.1f}x to {high:.1f}x)"
    )


if __name__ == "__main__":
    main()
