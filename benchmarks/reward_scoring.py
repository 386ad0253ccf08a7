"""Reward scoring throughput: ludic's client and /score against vLLM's own /classify.

    .venv/bin/python benchmarks/reward_scoring.py [--texts 512] [--batch 32] [--rounds 5]

Starts one ludic reward server (a tiny Qwen2 sequence classifier built locally, CPU) and
scores the same texts two ways, in alternating rounds after a warm-up round:

  (a) ludic:  ``VLLMRewardClient.score_batch`` (POST /score), ``--concurrency`` batches
              in flight;
  (b) direct: POST /classify with the same batches and concurrency from a bare
              ``httpx.AsyncClient`` (vLLM's own pooling route on the same server);
  (c) bare:   POST /score from that bare client, which splits any overhead of (a) into
              the client's part (a vs c) and the route's (c vs b).

Both ask for the sigmoid (``normalize=True`` / vLLM's default activation) and both check
that every text got a score. Prints the median texts/s of each, (a)/(b) as the median of
per-round ratios, the overhead 1 - (a)/(b) (goal: <= 5%), and the largest score
difference between (a) and (b).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

import httpx

from ludic.inference.vllm.process import start_vllm_server
from ludic.inference.vllm.reward_client import VLLMRewardClient
from ludic.models.tiny import save_tiny_reward_model


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Question/answer texts of 20 to 200 characters."""
    rng = random.Random(seed)
    words = [
        "the",
        "of",
        "a",
        "to",
        "in",
        "is",
        "reward",
        "model",
        "policy",
        "answer",
        "question",
        "seven",
        "plus",
        "two",
    ]
    texts = []
    for i in range(n):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(3, 35)))
        texts.append(f"Q{i}: what is {rng.randint(0, 99)} + {rng.randint(0, 99)}?\n{body}")
    return texts


def batches(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


async def run_batches(
    score: Callable[[list[str]], Awaitable[list[float]]], parts: list[list[str]], concurrency: int
) -> list[float]:
    """Score every batch with at most ``concurrency`` in flight; scores in text order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(part: list[str]) -> list[float]:
        async with gate:
            return await score(part)

    results = await asyncio.gather(*(one(p) for p in parts))
    return [s for r in results for s in r]


async def main_async(args: argparse.Namespace) -> None:
    texts = make_texts(args.texts)
    parts = batches(texts, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_reward_model(f"{tmp}/rm", seed=0)
        with start_vllm_server(model_dir, kind="reward") as server:
            client = VLLMRewardClient(server.url)
            direct = httpx.AsyncClient(base_url=server.url, timeout=120)
            model = (await direct.get("/v1/models")).json()["data"][0]["id"]

            async def via_ludic(part: list[str]) -> list[float]:
                return await client.score_batch(part, normalize=True)

            async def via_classify(part: list[str]) -> list[float]:
                reply = await direct.post("/classify", json={"model": model, "input": part})
                reply.raise_for_status()
                data = sorted(reply.json()["data"], key=lambda d: d["index"])
                return [float(d["probs"][0]) for d in data]

            async def via_score_raw(part: list[str]) -> list[float]:
                reply = await direct.post("/score", json={"input": part})
                reply.raise_for_status()
                return [float(d["score"]) for d in reply.json()["data"]]

            ways = {"a": via_ludic, "b": via_classify, "c": via_score_raw}
            scores = {k: await run_batches(fn, parts, args.concurrency) for k, fn in ways.items()}
            times: dict[str, list[float]] = {k: [] for k in ways}
            for _ in range(args.rounds):
                for k, fn in ways.items():
                    start = time.perf_counter()
                    got = await run_batches(fn, parts, args.concurrency)
                    times[k].append(time.perf_counter() - start)
                    assert len(got) == len(texts)
            await direct.aclose()
            await client.aclose()

    rate = {k: len(texts) / statistics.median(v) for k, v in times.items()}
    per_round = [b / a for a, b in zip(times["a"], times["b"])]
    diff = max(abs(x - y) for x, y in zip(scores["a"], scores["b"]))
    print(
        f"{len(texts)} texts in batches of {args.batch}, {args.concurrency} in flight, "
        f"{args.rounds} rounds of (a), (b), (c) in turn after a warm-up; medians"
    )
    print(f"{'(a) ludic /score':<22}{rate['a']:>9.1f} texts/s")
    print(f"{'(b) vLLM /classify':<22}{rate['b']:>9.1f} texts/s")
    print(f"{'(c) bare POST /score':<22}{rate['c']:>9.1f} texts/s")
    ratio = statistics.median(per_round)
    print(
        f"a/b {ratio:.3f} (range {min(per_round):.3f}-{max(per_round):.3f}); "
        f"overhead {100 * (1 - ratio):.1f}% (goal <= 5%); max |score difference| {diff:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
