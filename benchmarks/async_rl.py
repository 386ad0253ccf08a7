"""Synchronous vs asynchronous RL against a real vLLM CPU server.

    .venv/bin/python benchmarks/async_rl.py                     # ~4 min on 2 cores
    .venv/bin/python benchmarks/async_rl.py --steps 30 --rounds 3 --max-staleness 1

Every thread of the vLLM server (API server, engine core, worker and its OpenMP threads)
is pinned to core 1 and every thread of this process (trainer and rollout loop, one torch
thread) to core 0, so generation and training can overlap on a two-core machine and each
mode gets the same hardware. The task is the demo's (single-digit addition, GRPO, 8
prompts x 8 samples per step, 32 new tokens each) on a locally built model (hidden 256, 2
layers) for which one generation batch and one training step take comparable time: the
most overlap can gain is (G + T) / max(G, T), 2x when they are equal.

Per round, in turn (a change in machine load hits both alike): the same number of steps
(same sample budget) in ``sync`` mode (``Trainer.train``: generate, train, publish) and in
``async`` mode (``AsyncBatchSource(max_staleness=η)`` + ``Trainer.train_async``), each from
the same initial weights, published to the server as version 0 first. Printed: samples/s
of each and their ratio (the median over rounds; the issue's goal is async/sync >= 1.6),
the time split of each run (waiting for batches, update, publish) and how busy the
trainer's core was, the token ledger at the end of each run (``ludic.training.ledger``)
with the share of generated tokens dropped as stale, the staleness histogram of the trained items, and ``async_rl.png``: reward against wall-clock time for both modes.

``--learning`` adds the learning check (``--learning-only``: only it): the default task
(``ludic demo``: warm start, then its GRPO steps) with the vLLM backend (a server ludic starts,
unpinned), the sync run and an async run with the same steps (same samples), their greedy
evals, and ``async_rl_learning.png``: reward against training wall-clock for both.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import secrets
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import torch

from ludic.distributed import ClientPolicyPublisher, policy_state_dict
from ludic.inference import HFChatTemplate
from ludic.inference.vllm.client import VLLMChatClient
from ludic.inference.vllm.process import start_vllm_server
from ludic.models.tiny import save_tiny_model
from ludic.run.builders import make_algorithm, make_engine, make_requests, sampling_spec
from ludic.run.loading import load_config
from ludic.training import (
    AsyncBatchSource,
    GRPORequestStrategy,
    RolloutBatchSource,
    Trainer,
    TrainerConfig,
)

DEMO = Path(__file__).parents[1] / "src" / "ludic" / "configs" / "arithmetic_demo.yaml"
TRAINER_CORE, SERVER_CORE = 0, 1


def pin(pid: int, cores: set[int], *, children: bool) -> None:
    """Pin every thread of a process (and, with ``children``, of everything it started)
    to ``cores``; threads started later inherit it from the thread that starts them."""
    root = psutil.Process(pid)
    for proc in [root, *(root.children(recursive=True) if children else [])]:
        for thread in proc.threads():
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(thread.id, cores)


class StalenessRecorder:
    """A sample filter that keeps everything and records each item's staleness."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.ages: list[int] = []

    def __call__(self, item: Any) -> bool:
        assert self.trainer is not None
        if item.policy_version is not None:
            self.ages.append(self.trainer.step - item.policy_version)
        return True


def run_mode(mode: str, args: argparse.Namespace, model_dir: Path, client: VLLMChatClient):
    config = load_config(
        DEMO, [f"model.path={model_dir}", f"sampling.max_tokens={args.max_tokens}"]
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client.sync_weights(policy_state_dict(policy), version=0)  # both modes start alike
    engine = make_engine(config, client, HFChatTemplate(tokenizer))
    algorithm = make_algorithm(config)
    counter = [0]

    def next_requests():
        first = counter[0] * config.trainer.prompts_per_step
        counter[0] += 1
        base = sampling_spec(config)
        return [
            replace(req, inference=base.with_seed(1_000_003 * args.seed + req.env_seed))
            for req in make_requests(
                config, range(first, first + config.trainer.prompts_per_step), base
            )
        ]

    source: Any = RolloutBatchSource(
        engine,
        next_requests,
        algorithm.credit_assigner,
        request_strategy=GRPORequestStrategy(group_size=config.algorithm.group_size),
    )
    if mode == "async":
        source = AsyncBatchSource(
            source, max_staleness=args.max_staleness, max_concurrent=args.max_concurrent
        )
    recorder = StalenessRecorder()
    trainer = Trainer(
        policy,
        algorithm,
        source,
        TrainerConfig(lr=config.trainer.lr, pad_token_id=tokenizer.pad_token_id, seed=args.seed),
        publisher=ClientPolicyPublisher(client),
        sample_filter=recorder,
    )
    recorder.trainer = trainer
    curve: list[tuple[float, float]] = []
    start, cpu_start = time.perf_counter(), time.process_time()

    train = trainer.train_async if mode == "async" else trainer.train
    history = asyncio.run(train(args.steps))
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    elapsed = 0.0
    for m in history:  # steps end one after another; rebuild the clock from the step times
        elapsed += m["time/wait_s"] + m["time/train_s"] + m["time/sync_s"]
        curve.append((elapsed, m["reward/mean"]))
    samples = sum(m["num_items"] + m["dropped/stale"] for m in history)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "samples_per_s": samples / wall,
        "curve": curve,
        "ages": recorder.ages,
        "wait_s": sum(m["time/wait_s"] for m in history),
        "compute_s": sum(m["time/train_s"] + m["time/sync_s"] for m in history),
        "update_s": sum(m["time/train_s"] for m in history),
        "publish_s": sum(m["time/sync_s"] for m in history),
        "dropped": sum(m["dropped/stale"] for m in history),
        # the token ledger settled at the end (batches made ahead and discarded: aborted)
        "ledger": {k: int(v) for k, v in trainer.ledger.state().items()} if trainer.ledger else {},
    }


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hist) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, color in (("sync", "tab:blue"), ("async", "tab:orange")):
        for i, r in enumerate(results[mode]):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, color=color, alpha=0.8, label=mode if i == 0 else None)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("batch reward mean")
    ax.set_title("reward against wall-clock time")
    ax.legend()
    ages = collections.Counter(a for r in results["async"] for a in r["ages"])
    hist.bar(list(ages), list(ages.values()), color="tab:orange")
    hist.set_xlabel("staleness of trained items (versions)")
    hist.set_ylabel("items")
    hist.set_title("async staleness histogram")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def learning_check(args: argparse.Namespace) -> None:
    """The default task (``ludic demo``: warm start, then its GRPO steps) with the vLLM
    backend, sync and async, unpinned: greedy evals, wall-clock, and a reward curve."""
    from ludic import jobs

    pin(os.getpid(), set(range(os.cpu_count() or 1)), children=False)  # undo the pinning
    torch.set_num_threads(os.cpu_count() or 1)
    out = Path(tempfile.mkdtemp(prefix="ludic-async-learning-"))
    curves: dict[str, list[tuple[float, float]]] = {}
    for mode, extra in (
        ("sync", []),
        ("async", ["trainer.mode=async", f"trainer.max_staleness={args.max_staleness}"]),
    ):
        overrides = [f"output_dir={out / mode}", "inference.backend=vllm", *extra]
        run_dir = jobs.train(load_config(DEMO, overrides))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        rl = [r for r in records if r["phase"] == "rl"]
        elapsed, curve = 0.0, []
        for r in rl:  # training time only (evaluations and checkpoints left out)
            elapsed += r["time/wait_s"] + r["time/train_s"] + r["time/sync_s"]
            curve.append((elapsed, r["reward_mean"]))
        curves[mode] = curve
        evals = " -> ".join(f"{r['success_rate']:.2f}" for r in records if r["phase"] == "eval")
        ledger = json.loads((run_dir / "summary.json").read_text())["token_ledger"]
        stale = ledger["dropped_stale"] / max(ledger["generated"], 1)
        print(
            f"learning check {mode:5s}: greedy eval {evals}; {len(rl)} RL steps in "
            f"{elapsed:.0f} s of training time; token ledger (summary.json) "
            f"{json.dumps(ledger)}, stale-dropped share {stale:.2%}"
        )
    plot_learning(curves, args.out.with_name(args.out.stem + "_learning.png"))


def plot_learning(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, curve in curves.items():
        xs, ys = zip(*curve)
        k = 10  # a running mean over 10 steps
        smooth = [
            sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
            for i in range(len(ys))
        ]
        ax.plot(xs, smooth, label=mode)
    ax.set_xlabel("training wall-clock time (s)")
    ax.set_ylabel("batch reward mean (running mean of 10 steps)")
    ax.set_title("ludic demo on vLLM: sync vs async")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per sample")
    parser.add_argument(
        "--max-concurrent", type=int, default=None, help="batches generated at once (η + 1)"
    )
    parser.add_argument("--modes", default="sync,async", help="(profiling: just one of them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning", action="store_true", help="also run the learning check")
    parser.add_argument("--learning-only", action="store_true", help="only the learning check")
    parser.add_argument("--out", type=Path, default=Path("async_rl.png"))
    args = parser.parse_args()
    if args.learning_only:
        learning_check(args)
        return
    if os.cpu_count() is None or os.cpu_count() < 2:
        raise SystemExit("this benchmark needs two cores (one for the server, one for training)")

    root = Path(tempfile.mkdtemp(prefix="ludic-async-bench-"))
    model_dir = save_tiny_model(
        root / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64
    )
    api_key = secrets.token_hex(16)
    server = start_vllm_server(
        model_dir,
        api_key=api_key,
        log_path=root / "server.log",
        env={"VLLM_CPU_OMP_THREADS_BIND": str(SERVER_CORE)},
    )
    pin(server.pid, {SERVER_CORE}, children=True)
    pin(os.getpid(), {TRAINER_CORE}, children=False)  # not the server: it is our child
    torch.set_num_threads(1)
    client = VLLMChatClient(server.url, api_key=api_key, timeout_s=120.0)
    results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    try:
        client.init_weight_sync(master_port=server.group_port)
        for r in range(args.rounds):
            for mode in args.modes.split(","):
                res = run_mode(mode, args, model_dir, client)
                results[mode].append(res)
                print(
                    f"round {r + 1} {mode:5s}: {res['samples_per_s']:6.1f} samples/s "
                    f"({res['wall_s']:.1f} s; waiting for batches {res['wait_s']:.1f} s, "
                    f"update {res['update_s']:.1f} s + publish {res['publish_s']:.1f} s; "
                    f"dropped stale {res['dropped']}; trainer core busy {res['cpu_s'] / res['wall_s']:.0%})"
                )
                ledger = res["ledger"]
                stale = ledger["dropped_stale"] / max(ledger["generated"], 1)
                print(
                    f"  token ledger: {json.dumps(ledger)}; stale-dropped share of generated "
                    f"tokens {stale:.2%} (goal <= 1% at max_staleness 1)"
                )
    finally:
        client.close()
        server.stop()
    ratios = [
        a["samples_per_s"] / s["samples_per_s"] for s, a in zip(results["sync"], results["async"])
    ]
    print(
        f"async/sync samples/s: median {statistics.median(ratios):.2f} "
        f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}); goal >= 1.6"
    )
    ages = collections.Counter(a for r in results["async"] for a in r["ages"])
    print(
        "async staleness histogram (versions: items): "
        + ", ".join(f"{k}: {v}" for k, v in sorted(ages.items()))
    )
    plot(results, args.out)
    print(f"wrote {args.out}")
    if args.learning:
        learning_check(args)


if __name__ == "__main__":
    main()
