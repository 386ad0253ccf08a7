"""Reward loop (standalone vs colocate) and reward router (two servers vs one) on vLLM CPU.

    .venv/bin/python benchmarks/reward_loop.py                     # ~4 min on 2 cores
    .venv/bin/python benchmarks/reward_loop.py --rounds 15 --router-rounds 15
    .venv/bin/python benchmarks/reward_loop.py --only router --texts 512 --batch 16
    .venv/bin/python benchmarks/reward_loop.py --only loop --episodes 256 --concurrency 32

Models are built locally (``ludic.models.tiny``): a tiny causal LM for the policy and a
larger one-label sequence classifier as the reward model, so that scoring a batch costs
about as much as generating it. Every thread of each vLLM server is pinned to one core
(``VLLM_CPU_OMP_THREADS_BIND`` plus ``os.sched_setaffinity``, as in ``async_rl.py``); this
process and the router are not pinned. Prefix caching is off on the reward servers, so
scoring the same completion twice costs the same every time.

1. **Reward loop.** A policy server (core 1) and a reward server (core 0). Per run: a
   ``RolloutEngine`` (``max_concurrency`` episodes at once, ``on_episode=[loop.on_episode]``)
   generates ``--episodes`` single-turn QA episodes (seeded, ``max_tokens`` drawn between
   ``--min-tokens`` and ``--max-tokens``), then the ``RewardLoop`` itself runs as the
   rollout hook (``run_rollout_hooks([loop], rollouts)``, as ``RolloutBatchSource`` does).
   Its manager is ``make_reward_manager("naive", compute_score=DisRMScore(
   VLLMRewardClient(url)))``: one ``/score`` call per rollout, ``--num-workers`` at once.
   Timed: generate the batch and have every rollout scored, in ``colocate`` mode (scoring
   starts after the batch) and ``standalone`` mode (each rollout is scored as soon as its
   episode ends), same requests, in turn for ``--rounds`` rounds after a warm-up round.
   Colocate's two phases are the generation-only and scoring-only times. Every rollout
   must get a score (a failed one stops the benchmark).
2. **Router.** The policy server is stopped and a second reward server starts on core 1;
   ``start_router([A, B])`` runs ``ludic serve router`` over both. Per run: ``--texts``
   fresh texts (never scored before) in batches of ``--batch`` through
   ``VLLMRewardClient.score_batch``, ``--in-flight`` batches at once, sent to server A
   alone (the baseline), to the router, or half straight to each server (``split``: two
   servers without the router, which separates the router's cost from what two cores give
   on this machine), in rotating order for ``--router-rounds`` rounds after a warm-up.
   Per run the CPU time of each process (servers, router, this client) and of the
   whole machine (``/proc/stat``; ``other`` is what none of ours used) shows where it went.

Ratios are the median over rounds of the per-round ratio (the machine is noisy), with the
lowest and highest round. Goals: colocate/standalone wall time >= 1.3; router/one
throughput >= 1.7.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import psutil

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.envs import DatasetQAEnv
from ludic.inference import HFChatTemplate
from ludic.inference.request import InferenceSpec, SamplingSpec
from ludic.inference.router import start_router
from ludic.inference.vllm.client import VLLMChatClient
from ludic.inference.vllm.process import VLLMServerProcess, start_vllm_server
from ludic.inference.vllm.reward_client import VLLMRewardClient
from ludic.interaction import SingleAgentProtocol
from ludic.models.tiny import build_tiny_tokenizer, save_tiny_model, save_tiny_reward_model
from ludic.parsers import ParseResult
from ludic.rewards import REWARD_KEY, DisRMScore, RewardLoop, make_reward_manager
from ludic.rollouts.hooks import run_rollout_hooks
from ludic.training import EnvSpec, ProtocolSpec, RolloutEngine, RolloutRequest
from ludic.types import Rollout

A_CORE, POLICY_CORE, B_CORE = 0, 1, 1
REWARD_ARGS = ("--no-enable-prefix-caching",)
WORDS = (
    "the of a to in is reward model policy answer question seven plus two because so then "
    "first next sum carry digit result check"
)


def pin(pid: int, cores: set[int], *, children: bool) -> None:
    """Pin every thread of a process (and, with ``children``, of everything it started)
    to ``cores``; threads started later inherit it from the thread that starts them.
    (As in ``async_rl.py``.)"""
    root = psutil.Process(pid)
    for proc in [root, *(root.children(recursive=True) if children else [])]:
        for thread in proc.threads():
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(thread.id, cores)


def launch(
    stack: contextlib.ExitStack[None],
    model_dir: Path,
    kind: Literal["policy", "reward"],
    core: int,
    key: str,
    log: Path,
) -> VLLMServerProcess:
    """Start a server without waiting; the stack stops it whatever happens next."""
    server = start_vllm_server(
        model_dir,
        kind=kind,
        api_key=key,
        env={"VLLM_CPU_OMP_THREADS_BIND": str(core)},
        extra_args=REWARD_ARGS if kind == "reward" else (),
        log_path=log,
        wait=False,
    )
    stack.callback(server.stop)
    return server


def ready(server: VLLMServerProcess, core: int, pids: set[int]) -> None:
    """Wait for ``server``, pin it to ``core`` and note its processes in ``pids``."""
    server.wait_until_healthy()
    pin(server.pid, {core}, children=True)
    pids.update([server.pid, *(c.pid for c in psutil.Process(server.pid).children(recursive=True))])


def still_running(pids: set[int]) -> list[int]:
    """The processes of ``pids`` still alive (zombies waiting to be reaped count as gone)."""
    alive = []
    for pid in sorted(pids):
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


# ------------------------------------------------------------------------------ CPU time
def tree_cpu(pid: int, *, children: bool = True) -> float:
    """User + system seconds of a process (and its descendants)."""
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for proc in [root, *(root.children(recursive=True) if children else [])]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = proc.cpu_times()
                total += t.user + t.system
    return total


def machine_busy_s() -> float:
    """Busy seconds of all cores together since boot (``/proc/stat``: all but idle and
    iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user..steal minus idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds used by named process trees, by this process, and by the machine."""

    def __init__(self, trees: dict[str, int]) -> None:
        self.trees = trees

    def snapshot(self) -> dict[str, float]:
        out = {name: tree_cpu(pid) for name, pid in self.trees.items()}
        out["client"] = tree_cpu(os.getpid(), children=False)
        out["machine"] = machine_busy_s()
        return out

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        d = {k: after[k] - before[k] for k in before}
        d["other"] = d["machine"] - sum(v for k, v in d.items() if k != "machine")
        return d


# ------------------------------------------------------------------------------ helpers
def median_range(xs: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def verdict(ratio: float, goal: float) -> str:
    return "met" if ratio >= goal else f"missed by {goal - ratio:.2f}"


# ------------------------------------------------------------------------------ 1. loop
@dataclass
class LoopRun:
    mode: str
    wall_s: float
    generate_s: float
    """``engine.generate_rollouts`` (in standalone mode, scoring runs alongside)."""
    hook_s: float
    """The reward loop as rollout hook: all scoring (colocate) or what was left."""
    cpu: dict[str, float]
    """CPU seconds of the whole run (``CpuMeter.delta``)."""
    generate_cpu: dict[str, float]
    """The same, over ``generate_s`` only."""
    completions: list[str]
    scores: list[float]
    tokens: int


def loop_requests(args: argparse.Namespace) -> list[RolloutRequest]:
    rng = random.Random(args.seed)
    return [
        RolloutRequest(
            EnvSpec("qa"),
            ProtocolSpec("single"),
            env_seed=i,
            max_steps=1,
            inference=InferenceSpec(
                SamplingSpec(
                    temperature=1.0,
                    max_tokens=rng.randint(args.min_tokens, args.max_tokens),
                    seed=1_000_003 * args.seed + i,
                )
            ),
        )
        for i in range(args.episodes)
    ]


def loop_samples(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed + 1)
    samples = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        samples.append({"question": f"Problem {i}: what is {a} + {b}?", "answer": str(a + b)})
    return samples


def engine_factory(
    args: argparse.Namespace, chat: VLLMChatClient
) -> Callable[[Sequence[Callable[[list[Rollout]], None]]], RolloutEngine]:
    samples = loop_samples(args.episodes, args.seed)
    template = HFChatTemplate(build_tiny_tokenizer())

    def protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=chat,
            context=FullDialog(),
            parser=lambda text: ParseResult(action=text.strip()),
            chat_template=template,
        )
        return SingleAgentProtocol(agent)

    def make(on_episode: Sequence[Callable[[list[Rollout]], None]]) -> RolloutEngine:
        return RolloutEngine(
            {"qa": lambda: DatasetQAEnv(samples)},
            {"single": protocol},
            max_concurrency=args.concurrency,
            on_episode=on_episode,
        )

    return make


async def run_loop(
    mode: str,
    requests: list[RolloutRequest],
    make_engine: Callable[[Sequence[Callable[[list[Rollout]], None]]], RolloutEngine],
    reward: DisRMScore,
    num_workers: int,
    meter: CpuMeter,
) -> LoopRun:
    loop = RewardLoop(
        make_reward_manager("naive", compute_score=reward),
        mode=mode,  # type: ignore[arg-type]
        num_workers=num_workers,
    )
    engine = make_engine([loop.on_episode])
    cpu0 = meter.snapshot()
    start = time.perf_counter()
    try:
        rollouts = await engine.generate_rollouts(requests)
        generated = time.perf_counter()
        cpu1 = meter.snapshot()
        await run_rollout_hooks([loop], rollouts)
        end = time.perf_counter()
    finally:
        await loop.aclose()
    cpu2 = meter.snapshot()
    results = [r.meta[REWARD_KEY] for r in rollouts]
    failed = [x["error"] for x in results if x["score"] is None]
    if failed:
        raise RuntimeError(f"{mode}: {len(failed)} rollouts were not scored: {failed[0]}")
    steps = [r.agent_steps[-1] for r in rollouts]
    return LoopRun(
        mode=mode,
        wall_s=end - start,
        generate_s=generated - start,
        hook_s=end - generated,
        cpu=CpuMeter.delta(cpu0, cpu2),
        generate_cpu=CpuMeter.delta(cpu0, cpu1),
        completions=[s.completion for s in steps],
        scores=[float(x["score"]) for x in results],
        tokens=sum(len(s.trace.completion_token_ids) for s in steps if s.trace is not None),
    )


async def loop_benchmark(
    args: argparse.Namespace, policy: VLLMServerProcess, reward: VLLMServerProcess, key: str
) -> dict[str, list[LoopRun]]:
    chat = VLLMChatClient(policy.url, api_key=key, timeout_s=300.0)
    rm = VLLMRewardClient(reward.url, api_key=key, timeout_s=300.0)
    make_engine = engine_factory(args, chat)
    requests = loop_requests(args)
    score = DisRMScore(rm)
    meter = CpuMeter({"policy": policy.pid, "reward": reward.pid})

    async def run(mode: str) -> LoopRun:
        return await run_loop(mode, requests, make_engine, score, args.num_workers, meter)

    runs: dict[str, list[LoopRun]] = {"colocate": [], "standalone": []}
    print(
        f"\n[1] reward loop: {args.episodes} episodes (max_tokens {args.min_tokens}-"
        f"{args.max_tokens}, seeded), engine max_concurrency {args.concurrency}, "
        f"RewardLoop num_workers {args.num_workers}; this process "
        + ("unpinned" if args.client_core is None else f"pinned to core {args.client_core}"),
        flush=True,
    )
    try:
        for mode in ("colocate", "standalone"):  # warm-up: the first batches are slow
            warm = await run(mode)
            print(f"warm-up {mode:10s} {warm.wall_s:6.2f} s", flush=True)
        for r in range(args.rounds):
            order = ("colocate", "standalone") if r % 2 == 0 else ("standalone", "colocate")
            for mode in order:
                runs[mode].append(await run(mode))
            c, s = runs["colocate"][-1], runs["standalone"][-1]
            print(
                f"round {r + 1}: colocate {c.wall_s:5.2f} s (generate {c.generate_s:.2f} + "
                f"score {c.hook_s:.2f}), standalone {s.wall_s:5.2f} s (generate+score "
                f"{s.generate_s:.2f} + rest {s.hook_s:.2f}); colocate/standalone "
                f"{c.wall_s / s.wall_s:.2f}",
                flush=True,
            )
    finally:
        await chat.aclose()
        await rm.aclose()
    return runs


# ------------------------------------------------------------------------------ 2. router
def make_texts(n: int, chars: int, tag: str, rng: random.Random) -> list[str]:
    """``n`` question/answer texts of about ``chars`` characters (half to 1.5x), each
    starting with ``tag`` so that no two runs share a prefix."""
    words = WORDS.split()
    texts = []
    for i in range(n):
        target = rng.randint(chars // 2, 3 * chars // 2)
        text = f"[{tag}:{i}] Q: what is {rng.randint(0, 99)} + {rng.randint(0, 99)}?\nA:"
        while len(text) < target:
            text += " " + rng.choice(words)
        texts.append(text)
    return texts


@dataclass
class RouterRun:
    wall_s: float
    texts: int
    cpu: dict[str, float]
    served: list[int]

    @property
    def rate(self) -> float:
        return self.texts / self.wall_s


async def score_all(
    clients: Sequence[VLLMRewardClient], texts: list[str], batch: int, in_flight: int
) -> list[float]:
    """Score ``texts`` in batches, ``in_flight`` at once; with several clients, batch i
    goes to client i mod n, each with its share of ``in_flight``."""
    gates = [asyncio.Semaphore(max(1, in_flight // len(clients))) for _ in clients]

    async def one(i: int, part: list[str]) -> list[float]:
        k = i % len(clients)
        async with gates[k]:
            return await clients[k].score_batch(part)

    parts = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(parts)))
    return [s for r in results for s in r]


async def router_benchmark(
    args: argparse.Namespace,
    a: VLLMServerProcess,
    b: VLLMServerProcess,
    router: VLLMServerProcess,
    key: str,
) -> dict[str, list[RouterRun]]:
    direct_a = VLLMRewardClient(a.url, api_key=key, timeout_s=300.0)
    direct_b = VLLMRewardClient(b.url, api_key=key, timeout_s=300.0)
    clients: dict[str, list[VLLMRewardClient]] = {
        "one": [direct_a],
        "router": [VLLMRewardClient(router.url, api_key=key, timeout_s=300.0)],
        "split": [direct_a, direct_b],  # no router: half the batches straight to each
    }
    meter = CpuMeter({"A": a.pid, "B": b.pid, "router": router.pid})
    auth = {"Authorization": f"Bearer {key}"}
    http = httpx.AsyncClient(base_url=router.url, headers=auth, timeout=30.0)
    rng = random.Random(args.seed)
    counter = [0]

    async def served() -> list[int]:
        reply = await http.get("/router/backends")
        reply.raise_for_status()
        return [int(x["served"]) for x in reply.json()["backends"]]

    async def run(way: str, client: list[VLLMRewardClient]) -> RouterRun:
        counter[0] += 1
        texts = make_texts(args.texts, args.text_chars, f"run{counter[0]}", rng)
        served0 = await served()
        before = meter.snapshot()
        start = time.perf_counter()
        scores = await score_all(client, texts, args.batch, args.in_flight)
        wall = time.perf_counter() - start
        cpu = CpuMeter.delta(before, meter.snapshot())
        if len(scores) != len(texts):
            raise RuntimeError(f"{way}: {len(scores)} scores for {len(texts)} texts")
        served1 = await served()
        return RouterRun(wall, len(texts), cpu, [y - x for x, y in zip(served0, served1)])

    runs: dict[str, list[RouterRun]] = {"one": [], "router": [], "split": []}
    print(
        f"\n[2] router: {args.texts} texts (~{args.text_chars} chars) per run in batches of "
        f"{args.batch}, {args.in_flight} batches in flight; server A (core {A_CORE}) alone "
        f"vs the router over A and B (core {B_CORE})",
        flush=True,
    )
    try:
        warm_up = {"one": [direct_a], "B": [direct_b], **clients}
        for way, group in warm_up.items():
            warm = await run(way, group)
            print(f"warm-up {way:6s} {warm.rate:6.1f} texts/s", flush=True)
        ways = list(runs)
        for r in range(args.router_rounds):
            for way in ways[r % len(ways) :] + ways[: r % len(ways)]:  # rotate the order
                runs[way].append(await run(way, clients[way]))
            o, t, d = runs["one"][-1], runs["router"][-1], runs["split"][-1]
            c = t.cpu
            print(
                f"round {r + 1}: one {o.rate:6.1f} texts/s ({o.wall_s:.2f} s; CPU s: A "
                f"{o.cpu['A']:.2f}, other {o.cpu['other']:.2f}), router {t.rate:6.1f} texts/s "
                f"({t.wall_s:.2f} s; CPU s: A {c['A']:.2f}, B {c['B']:.2f}, router "
                f"{c['router']:.2f}, client {c['client']:.2f}, other {c['other']:.2f}; "
                f"requests A/B {t.served[0]}/{t.served[1]}), split {d.rate:6.1f} texts/s "
                f"(CPU s: A {d.cpu['A']:.2f}, B {d.cpu['B']:.2f}); router/one "
                f"{t.rate / o.rate:.2f}, split/one {d.rate / o.rate:.2f}",
                flush=True,
            )
    finally:
        await http.aclose()
        for client in (direct_a, direct_b, *clients["router"]):
            await client.aclose()
    return runs


# ------------------------------------------------------------------------------ report
def report(
    loop_runs: dict[str, list[LoopRun]] | None,
    router_runs: dict[str, list[RouterRun]] | None,
) -> None:
    print("\nsummary (medians over rounds; ratio range = lowest-highest round)")
    header = f"{'':34s}{'baseline':>14s}{'ludic':>14s}{'ratio':>8s}{'range':>12s}   goal"
    print(header)
    if loop_runs:
        col, sta = loop_runs["colocate"], loop_runs["standalone"]
        ratio, lo, hi = median_range([c.wall_s / s.wall_s for c, s in zip(col, sta)])
        c_wall = statistics.median(c.wall_s for c in col)
        s_wall = statistics.median(s.wall_s for s in sta)
        print(
            f"{'colocate / standalone (wall)':34s}{c_wall:>12.2f} s{s_wall:>12.2f} s"
            f"{ratio:>8.2f}{f'{lo:.2f}-{hi:.2f}':>12s}   >= 1.3: {verdict(ratio, 1.3)}"
        )
        gen = statistics.median(c.generate_s for c in col)
        score = statistics.median(c.hook_s for c in col)
        rest = statistics.median(s.hook_s for s in sta)
        sgen = statistics.median(s.generate_s for s in sta)
        print(
            f"  generation only {gen:.2f} s, scoring only {score:.2f} s (colocate's two "
            f"phases; scoring/generation {score / gen:.2f})"
        )
        print(
            f"  standalone: generation with scoring alongside {sgen:.2f} s, then the scoring "
            f"left {rest:.2f} s"
        )

        client = {
            name: statistics.median(r.cpu["client"] for r in runs)
            for name, runs in (("colocate", col), ("standalone", sta))
        }
        busy = {
            name: statistics.median(r.generate_cpu["policy"] / r.generate_s for r in runs)
            for name, runs in (("colocate", col), ("standalone", sta))
        }
        print(
            f"  this process (engine, reward loop, clients): {client['colocate']:.2f} / "
            f"{client['standalone']:.2f} CPU s per batch (colocate / standalone); the policy "
            f"server had its core {busy['colocate']:.0%} / {busy['standalone']:.0%} of the "
            "generation time (vLLM spins while idle: 100% = it never gave the core up)"
        )
        same = sum(x == y for x, y in zip(col[-1].completions, sta[-1].completions))
        diffs = [
            abs(p - q)
            for c, s in zip(col, sta)
            for p, q, x, y in zip(c.scores, s.scores, c.completions, s.completions)
            if x == y
        ]
        print(
            f"  {col[-1].tokens} completion tokens per batch; identical completions in both "
            f"modes (last round) {same}/{len(col[-1].completions)}, largest score difference "
            f"on identical completions {max(diffs, default=0.0):.1e}"
        )
    if router_runs:
        one, two, split = router_runs["one"], router_runs["router"], router_runs["split"]
        ratio, lo, hi = median_range([t.rate / o.rate for o, t in zip(one, two)])
        o_rate = statistics.median(o.rate for o in one)
        t_rate = statistics.median(t.rate for t in two)
        d_rate = statistics.median(d.rate for d in split)
        print(
            f"{'router (A+B) / server A (texts/s)':34s}{o_rate:>14.1f}{t_rate:>14.1f}"
            f"{ratio:>8.2f}{f'{lo:.2f}-{hi:.2f}':>12s}   >= 1.7: {verdict(ratio, 1.7)}"
        )
        d_ratio, d_lo, d_hi = median_range([d.rate / o.rate for o, d in zip(one, split)])
        print(
            f"{'  no router, A+B split / A':34s}{o_rate:>14.1f}{d_rate:>14.1f}"
            f"{d_ratio:>8.2f}{f'{d_lo:.2f}-{d_hi:.2f}':>12s}   (what two cores give here)"
        )
        r_ratio, r_lo, r_hi = median_range([t.rate / d.rate for d, t in zip(split, two)])
        print(
            f"{'  router / no router':34s}{d_rate:>14.1f}{t_rate:>14.1f}"
            f"{r_ratio:>8.2f}{f'{r_lo:.2f}-{r_hi:.2f}':>12s}   (the router's own cost)"
        )

        def cpu(runs: list[RouterRun]) -> str:
            med = {k: statistics.median(r.cpu[k] for r in runs) for k in runs[0].cpu}
            wall = statistics.median(r.wall_s for r in runs)
            parts = ", ".join(
                f"{k} {med[k]:.2f}" for k in ("A", "B", "router", "client", "other") if k in med
            )
            return f"wall {wall:.2f} s: {parts}"

        print("  CPU s per run (medians; 'other' = processes not ours):")
        for name, runs in (("server A alone", one), ("router", two), ("no router", split)):
            print(f"    {name:15s} {cpu(runs)}")


# ------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["loop", "router"], default=None)
    parser.add_argument("--rounds", type=int, default=9, help="reward-loop rounds")
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16, help="engine max_concurrency")
    parser.add_argument("--num-workers", type=int, default=16, help="RewardLoop num_workers")
    parser.add_argument(
        "--client-core",
        type=int,
        default=None,
        help="pin this process to a core during the reward-loop part (default: unpinned)",
    )
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--policy-hidden", type=int, default=256)
    parser.add_argument("--policy-layers", type=int, default=2)
    parser.add_argument("--reward-hidden", type=int, default=512)
    parser.add_argument("--reward-layers", type=int, default=4)
    parser.add_argument("--router-rounds", type=int, default=9)
    parser.add_argument("--texts", type=int, default=256, help="texts per router run")
    parser.add_argument("--text-chars", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8, help="texts per /score request")
    parser.add_argument("--in-flight", type=int, default=16, help="requests at once")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("this benchmark needs two cores (one per server)")

    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="ludic-reward-loop-bench-"))
    policy_dir = save_tiny_model(
        root / "policy",
        hidden_size=args.policy_hidden,
        num_layers=args.policy_layers,
        num_heads=args.policy_hidden // 64,
    )
    reward_dir = save_tiny_reward_model(
        root / "reward",
        hidden_size=args.reward_hidden,
        num_layers=args.reward_layers,
        num_heads=args.reward_hidden // 64,
    )
    print(
        f"policy: hidden {args.policy_hidden} x {args.policy_layers} layers (core "
        f"{POLICY_CORE}); reward model: hidden {args.reward_hidden} x {args.reward_layers} "
        f"layers (A: core {A_CORE}, B: core {B_CORE}); logs in {root}",
        flush=True,
    )
    key = secrets.token_hex(16)
    loop_runs = router_runs = None
    pids: set[int] = set()
    with contextlib.ExitStack() as stack:
        a = launch(stack, reward_dir, "reward", A_CORE, key, root / "reward_a.log")
        if args.only != "router":
            with contextlib.ExitStack() as policy_stack:
                policy = launch(
                    policy_stack, policy_dir, "policy", POLICY_CORE, key, root / "policy.log"
                )
                ready(a, A_CORE, pids)
                ready(policy, POLICY_CORE, pids)
                print(f"servers up after {time.perf_counter() - started:.0f} s", flush=True)
                if args.client_core is not None:
                    pin(os.getpid(), {args.client_core}, children=False)
                try:
                    loop_runs = asyncio.run(loop_benchmark(args, policy, a, key))
                finally:  # unpinned again (B and the router start from this process)
                    pin(os.getpid(), set(range(os.cpu_count() or 1)), children=False)
        if args.only != "loop":
            b = launch(stack, reward_dir, "reward", B_CORE, key, root / "reward_b.log")
            ready(a, A_CORE, pids)
            ready(b, B_CORE, pids)
            router = stack.enter_context(
                start_router(
                    [a.url, b.url],
                    api_key=key,
                    backend_api_key=key,
                    health_interval_s=2.0,
                    log_path=root / "router.log",
                )
            )
            pids.add(router.pid)
            print(f"router up after {time.perf_counter() - started:.0f} s", flush=True)
            router_runs = asyncio.run(router_benchmark(args, a, b, router, key))
    left = still_running(pids)
    report(loop_runs, router_runs)
    print(
        f"total {time.perf_counter() - started:.0f} s; servers and router stopped "
        f"({len(pids)} processes, still running: {left or 'none'})"
    )


if __name__ == "__main__":
    main()
