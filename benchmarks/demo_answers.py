"""What a demo run's final policy answers on the held-out problems it gets wrong.

    .venv/bin/python benchmarks/demo_answers.py RUN_DIR

For each problem of the run's evaluation range (``eval.first_problem`` ..
``+ eval.num_problems``; the env's reset seed picks the problem) whose greedy answer is
wrong: the question, the right answer, the greedy answer, and the probability that one
sample at the run's sampling temperature is the right answer (its tokens, then the end of
turn), all under ``RUN_DIR/policy`` with the run's chat template. Single-turn QA envs
(``DatasetQAEnv``, e.g. the demo's arithmetic) only.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ludic.run.builders import build_env
from ludic.run.loading import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    config = load_config(args.run_dir / "config.yaml")
    policy = args.run_dir / "policy"
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    env = build_env(config)
    temperature = config.sampling.temperature
    first, count = config.eval.first_problem, config.eval.num_problems
    wrong = []
    for seed in range(first, first + count):
        question = env.render_prompt(env.samples[seed % len(env.samples)])
        answer = str(env.samples[seed % len(env.samples)][env.answer_key])
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
        )
        greedy = _greedy(model, list(prompt), tokenizer.eos_token_id, config.sampling.max_tokens)
        said = tokenizer.decode(greedy, skip_special_tokens=True).strip()
        if said != answer:
            target = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            logp = _logprob(model, list(prompt), target, temperature)
            wrong.append((seed, question, answer, said, math.exp(logp)))
    print(f"{config.name} seed {config.seed}: {count - len(wrong)} of {count} right (greedy)")
    for seed, question, answer, said, p in wrong:
        print(
            f"  problem {seed:3d}  {question!r:8} answer {answer!r:5} greedy {said!r:6} "
            f"p(answer) at T={temperature}: {p:.1e}"
        )


@torch.no_grad()
def _greedy(model, prompt: list[int], eos: int, max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if token == eos:
            break
        ids.append(token)
    return ids[len(prompt) :]


@torch.no_grad()
def _logprob(model, prompt: list[int], target: list[int], temperature: float) -> float:
    logits = model(torch.tensor([prompt + target])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(target))


if __name__ == "__main__":
    main()
