"""Data-parallel inference on vLLM CPU: two policy servers (one core each) vs one, behind
``VLLMClientPool``; and one publish to two servers vs one, in both publish modes.

    .venv/bin/python benchmarks/data_parallel.py                    # ~4 min on 2 cores
    .venv/bin/python benchmarks/data_parallel.py --rounds 7 --requests 96 --tokens 64
    .venv/bin/python benchmarks/data_parallel.py --only publish --hidden 512 --layers 8

One locally built model (``ludic.models.tiny``, ``--hidden`` x ``--layers``) is served by
server A (core 0) and server B (core 1); every thread of each server is pinned to its
core (``VLLM_CPU_OMP_THREADS_BIND`` plus ``os.sched_setaffinity``, as in
``reward_loop.py``). This process (the client and the trainer's side of the weight sync)
is not pinned.

1. **Rollout throughput.** Per run: ``--requests`` completions of ``--tokens`` tokens each
   (``ignore_eos``, seeded random prompts, no session), ``--concurrency`` in flight,
   through a pool of server A alone (the baseline) or of A and B. The ratio is one
   server's wall time over two servers'. Goal >= 1.7.
2. **Publish.** Per run: a pool forms its weight-sync group(s), then ``--publishes``
   full-model publishes are timed (``sync_weights``: extract, announce, broadcast, load,
   wait until applied, every server). Pools: A alone (the baseline), A and B with a group
   each (``per_server``, pushed concurrently) and A and B in one group (``one_group``). The
   ratio is two servers' time over one server's. Goal <= 1.3.

Each round runs every variant once, in rotating order; ratios are the median over rounds
of the per-round ratio (the machine is noisy), with the lowest and highest round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import torch
from reward_loop import launch, ready, tree_cpu  # benchmarks/ is on sys.path when run as a script

from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec
from ludic.inference.vllm.pool import VLLMClientPool
from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer, save_tiny_model

A_CORE, B_CORE = 0, 1


def throughput_run(
    urls: list[str], key: str, args: argparse.Namespace, seed: int, pids: dict[str, int]
) -> tuple[float, dict[str, float]]:
    """Seconds to generate ``args.requests`` completions through a pool of ``urls``, and
    the CPU seconds each server (``pids``: name -> pid) and this process used meanwhile."""
    rng = random.Random(seed)
    spec = InferenceSpec(
        sampling=SamplingSpec(temperature=1.0, max_tokens=args.tokens, seed=None),
        extra={"ignore_eos": True},
    )
    requests = [
        CompletionRequest(tuple(rng.randrange(3, 250) for _ in range(16)), spec)
        for _ in range(args.requests)
    ]

    async def go() -> tuple[float, dict[str, float]]:
        with VLLMClientPool.connect(urls, api_key=key, timeout_s=300.0) as pool:
            gate = asyncio.Semaphore(args.concurrency)

            async def one(request: CompletionRequest) -> int:
                async with gate:
                    response = await pool.complete(request)
                    return len(response.trace.completion_token_ids)

            for server in pool.servers:  # connections and model names, before the clock
                await server.client.complete(requests[0])
            cpu = {name: tree_cpu(pid) for name, pid in pids.items()}
            cpu["client"] = time.process_time()
            started = time.perf_counter()
            lengths = await asyncio.gather(*(one(r) for r in requests))
            elapsed = time.perf_counter() - started
            cpu = {name: tree_cpu(pid) - cpu[name] for name, pid in pids.items()} | {
                "client": time.process_time() - cpu["client"]
            }
            assert all(n == args.tokens for n in lengths), "a completion came back short"
            await pool.aclose()
            return elapsed, cpu

    return asyncio.run(go())


def publish_run(
    urls: list[str], key: str, mode: str, state: dict[str, torch.Tensor], args: argparse.Namespace
) -> float:
    """Seconds for ``args.publishes`` publishes of ``state`` through a pool of ``urls``."""
    with VLLMClientPool.connect(urls, api_key=key, timeout_s=300.0, publish=mode) as pool:
        pool.init_weight_sync()
        pool.sync_weights(state, version=1)  # warm-up: buffers, layouts by id
        started = time.perf_counter()
        for version in range(2, 2 + args.publishes):
            pool.sync_weights(state, version=version)
        elapsed = time.perf_counter() - started
        assert {s["version"] for s in pool.status()} == {1 + args.publishes}
        return elapsed


def summarize(name: str, ratios: list[float], goal: str) -> None:
    print(
        f"{name}: median {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds; goal {goal})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["throughput", "publish"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--publishes", type=int, default=5)
    args = parser.parse_args()

    key = secrets.token_urlsafe(16)
    model_config = {"hidden_size": args.hidden, "num_layers": args.layers}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        model_dir = save_tiny_model(root / "model", **model_config)
        a = launch(stack, model_dir, "policy", A_CORE, key, root / "a.log")
        b = launch(stack, model_dir, "policy", B_CORE, key, root / "b.log")
        pids: set[int] = set()
        ready(a, A_CORE, pids)
        ready(b, B_CORE, pids)
        one, two = [a.url], [a.url, b.url]
        state = build_tiny_causal_lm(build_tiny_tokenizer(), seed=1, **model_config).state_dict()
        mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        print(f"model: hidden {args.hidden} x {args.layers} layers, {mib:.1f} MiB float32")

        if args.only in (None, "throughput"):
            server_pids = {"A": a.pid, "B": b.pid}
            throughput_run(two, key, args, -1, server_pids)  # warm-up
            ratios = []
            for r in range(args.rounds):
                times, cpus = {}, {}
                for name in ["one", "two"] if r % 2 == 0 else ["two", "one"]:
                    urls = one if name == "one" else two
                    times[name], cpus[name] = throughput_run(urls, key, args, r, server_pids)
                ratios.append(times["one"] / times["two"])
                per_s = {k: args.requests * args.tokens / v for k, v in times.items()}
                cpu = {k: ", ".join(f"{n} {v:.2f}" for n, v in c.items()) for k, c in cpus.items()}
                print(
                    f"  round {r}: one {per_s['one']:.0f} tok/s ({times['one']:.2f} s; CPU s: "
                    f"{cpu['one']}), two {per_s['two']:.0f} tok/s ({times['two']:.2f} s; CPU s: "
                    f"{cpu['two']}); ratio {ratios[-1]:.2f}"
                )
            summarize("rollout throughput, two servers / one", ratios, ">= 1.7")

        if args.only in (None, "publish"):
            variants = [("one", one, "per_server"), ("per_server", two, "per_server")]
            variants.append(("one_group", two, "one_group"))
            ratios_ps, ratios_og = [], []
            for r in range(args.rounds):
                order = variants[r % 3 :] + variants[: r % 3]
                times = {
                    name: publish_run(urls, key, mode, state, args) for name, urls, mode in order
                }
                ratios_ps.append(times["per_server"] / times["one"])
                ratios_og.append(times["one_group"] / times["one"])
                per = {k: 1000 * v / args.publishes for k, v in times.items()}
                print(
                    f"  round {r}: one {per['one']:.0f} ms, per_server {per['per_server']:.0f} ms, "
                    f"one_group {per['one_group']:.0f} ms per publish"
                )
            summarize("publish to two servers / one, per_server", ratios_ps, "<= 1.3")
            summarize("publish to two servers / one, one_group", ratios_og, "<= 1.3")


if __name__ == "__main__":
    main()
