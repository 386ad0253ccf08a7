"""What verifying a weight sync costs: syncs into a real vLLM CPU server with
``verify_sync: every`` against the same syncs with ``off``, interleaved, on the tiny model
and on a Qwen2.5-0.5B-shaped model (random weights, built here; float32, as vLLM's CPU
defaults serve it).

    .venv/bin/python benchmarks/sync_verify.py [--rounds 5] [--models tiny,qwen0.5b]

Per model it prints the median seconds of a sync with verification off and on, the
median (and range) over rounds of their ratio within a round, and the cost's parts: the trainer's checksums of what it sends, the workers' of
what they receive and load (reported by the worker), and fetching and checking the
report. The canary (one forward of 24 tokens on each side, run on the first sync and
every ``canary_every`` = 10 syncs) is timed apart and given per sync at that rate.
The trainer (this process, one thread) is pinned to core 0 and the vLLM server to core 1
(``--cores`` changes them), so neither stalls the other; nothing else should run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ludic.distributed.weight_transfer.verify import SentChecksums, check_reports
from ludic.inference.vllm.canary import ModelCanary, server_canary
from ludic.inference.vllm.client import VLLMChatClient
from ludic.inference.vllm.process import start_vllm_server
from ludic.models.tiny import build_tiny_tokenizer, save_tiny_model

QWEN05_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
"""Qwen2.5-0.5B's architecture (494M parameters, tied embeddings)."""


def save_qwen05_shape(path: Path) -> Path:
    """A randomly initialised model of Qwen2.5-0.5B's shape (float32) with ludic's tiny
    tokenizer, as an HF folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        **QWEN05_SHAPE,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def measure(model_dir: Path, rounds: int, log: Path, server_cores: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = dict(trainer.state_dict())
    with start_vllm_server(
        model_dir, api_key="bench", log_path=log, cpu_cores=server_cores
    ) as server:
        client = VLLMChatClient(server.url, api_key="bench", timeout_s=600.0)
        client.init_weight_sync(master_port=server.group_port)
        session = client.weight_sync
        times: dict[str, list[float]] = {"off": [], "every": []}
        worker_s: list[float] = []
        version = 0
        for r in range(rounds + 1):  # round 0 warms up both paths
            for mode in ("off", "every") if r % 2 else ("every", "off"):
                session.verify_sync = mode
                version += 1
                started = time.perf_counter()
                client.sync_weights(params, version=version)
                seconds = time.perf_counter() - started
                if r:
                    times[mode].append(seconds)
                    if mode == "every":
                        report = client.control.weight_report()
                        worker_s.append(max(w["seconds"] for w in report["workers"]))
        trainer_sums, check = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            sent = SentChecksums()
            sent.record(list(params), list(params.values()))
            trainer_sums.append(time.perf_counter() - started)
            started = time.perf_counter()
            report = client.control.weight_report()
            check_reports(sent, report["workers"], server=server.url, version=version)
            check.append(time.perf_counter() - started)
        canary = ModelCanary(trainer)
        canary_s = []
        for _ in range(rounds):
            started = time.perf_counter()
            canary.logprobs()
            server_canary(client.control, canary.ids)
            canary_s.append(time.perf_counter() - started)
        client.close()
    paired = [e / o - 1 for e, o in zip(times["every"], times["off"])]  # same round
    return {
        "off": statistics.median(times["off"]),
        "every": statistics.median(times["every"]),
        "paired": statistics.median(paired),
        "paired_range": (min(paired), max(paired)),
        "trainer_sums": statistics.median(trainer_sums),
        "worker_sums": statistics.median(worker_s),
        "report_and_check": statistics.median(check),
        "canary": statistics.median(canary_s),
        "bytes": sum(t.numel() * t.element_size() for t in params.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="tiny,qwen0.5b")
    parser.add_argument("--cores", default="0,1", help="trainer core, server core(s)")
    args = parser.parse_args()
    trainer_core, server_cores = args.cores.split(",", 1)
    os.sched_setaffinity(0, {int(trainer_core)})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in args.models.split(","):
            if name == "tiny":
                model_dir = save_tiny_model(root / name)
            elif name == "qwen0.5b":
                model_dir = save_qwen05_shape(root / name)
            else:
                raise SystemExit(f"--models: unknown {name!r}; expected tiny, qwen0.5b")
            m = measure(model_dir, args.rounds, root / f"{name}.log", server_cores)
            low, high = m["paired_range"]
            print(
                f"{name}: {m['bytes'] / 2**20:.0f} MiB, sync {m['off']:.3f} s with "
                f"verify_sync=off, {m['every']:.3f} s with every (medians of {args.rounds}); "
                f"every/off - 1 within a round: median {100 * m['paired']:+.1f}% "
                f"(from {100 * low:+.1f}% to {100 * high:+.1f}%)"
            )
            print(
                f"  parts: trainer checksums {m['trainer_sums']:.3f} s, worker checksums "
                f"{m['worker_sums']:.3f} s, report + check {m['report_and_check']:.3f} s; "
                f"canary {m['canary']:.3f} s once = "
                f"{100 * m['canary'] / 10 / m['off']:.1f}% of a sync at canary_every=10"
            )


if __name__ == "__main__":
    main()
