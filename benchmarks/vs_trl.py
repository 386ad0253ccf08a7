"""ludic's GRPO step on the path users run (``ludic train``) against TRL's ``GRPOTrainer``.

    .venv/bin/python benchmarks/vs_trl.py --rounds 3 --long 125  # step time, ~7 min
    .venv/bin/python benchmarks/vs_trl.py accuracy --seeds 0 1 2 # time to accuracy
    .venv/bin/python benchmarks/vs_trl.py split torch_threads=2  # ludic's split, one change
    pip install 'ludic-rl[bench]'                                # TRL

Both train the same tiny model folder (``save_tiny_model``, the demo's shape) on the same
problems (the demo's arithmetic env: 100 single-digit additions), with the same batch and
hyperparameters: ``--prompts`` prompts x ``--group`` samples, up to ``--new-tokens`` new
tokens (both stop a row at EOS), temperature 1, learning rate 1e-4, no KL, one optimizer
step per batch, the same reward (ludic's ``answer`` parser and the env's ``numeric_match``:
1 right, 0 wrong, -0.1 empty).

* ludic: the ``ludic train`` command on the demo config (``src/ludic/configs/arithmetic_demo.
  yaml``) with only those settings overridden (and no warm start, and ``eval.every=0``: the
  demo's evaluation every 100 steps would fall in the long runs only, and TRL's run has
  none; and ``algorithm.negative_group_coef=0``: GRPO's advantages, as TRL's; the
  ``accuracy`` subcommand's RL phase sets it too): every other default is the user's (the
  in-process backend re-synced after every step, checkpoints every 25 steps, the console
  and metrics logs).
* TRL: ``GRPOTrainer`` (``use_vllm=False``: it generates with the training model) with
  ``GRPOConfig``'s defaults but for those settings, float32 and no activation checkpointing as
  ludic runs (``bf16: false``, ``gradient_checkpointing: false``; GRPOConfig's defaults, bf16
  autocast and checkpointing, are slower on a CPU without bf16 units: 1.4 s a demo step on
  this project's AMD EPYC machine), and ``use_cpu``, ``report_to: none``,
  ``save_strategy: no``, ``seed: 0``); the prompts as chat messages (the tokenizer's chat
  template, as ludic renders them).

**What is timed**: a run's wall time from process start to exit, at ``--short`` and
``--long`` steps; the time per step is the difference over the extra steps, so start-up,
model loading and the evaluations at the start and end (the same in both runs) cancel and
what remains is what a step costs on that path (generation, reward, loss, update, sync,
logging, checkpoints). Each process is pinned to ``--cores`` (``taskset``) and picks its
own torch threads, as a user's run does (``OMP_NUM_THREADS`` is unset). The runs are interleaved in rounds (ludic short, TRL short, ludic long, TRL
long, after one untimed warm-up run of each), so a change in machine load hits both; the ratio printed is the median over rounds
of ludic's step time over TRL's (below 1: ludic is faster).

**In the training loop**: the same difference of a long and a short run, of the seconds each
spent in its training loop (ludic: ``time/step_s`` summed over the RL steps, each step from
the previous step's metrics to its own; TRL: ``train_runtime``). Process start-up, imports
and model loading are left out of both, so this second ratio is the less noisy one where the
machine's speed drifts during the minutes of a round.

**ludic's step split**: the mean per step, over the long runs' steps after the fifth, of the
trainer's ``time/`` metrics: the wait for the batch and, inside it, the stages of
:mod:`ludic.timing` (chat template and tokenization, sampling, env, parser, credit
assignment), then the update and the weight sync, and logging and checkpoints; "rest of the
wait" is the wait less its stages (the rollout engine, the agent, the event loop);
"step" is ``time/step_s``, and "rest of the step" what it holds besides the wait, update,
sync, logging and checkpoint (the metrics, the run's hooks between steps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "ludic" / "configs" / "arithmetic_demo.yaml"


# ----------------------------------------------------------------------------- TRL side
def trl_main(argv: list[str]) -> None:
    """Train with TRL's GRPOTrainer (run in its own process: ``vs_trl.py trl ...``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lr-schedule", default="constant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="save the trained model here")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from ludic.envs import ArithmeticQAEnv
    from ludic.envs.dataset_qa_env import numeric_match
    from ludic.run.parts import plain_answer_parser

    env = ArithmeticQAEnv(**_demo_env_kwargs())
    rows = []
    for seed in range(len(env.samples)):
        (obs, _), target = env.reset(seed=seed)[env.agent_id], env.reference_answer()
        rows.append({"prompt": [{"role": "user", "content": obs}], "target": target})
    data = Dataset.from_list(rows * (args.steps * args.prompts // len(rows) + 2))

    def reward(completions, target, **_):
        scores = []
        for completion, answer in zip(completions, target):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            parsed = plain_answer_parser(text)
            scores.append(
                parsed.reward
                if parsed.action is None
                else float(numeric_match(parsed.action, answer))
            )
        return scores

    config = GRPOConfig(
        output_dir=args.workdir,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_schedule,
        beta=0.0,
        # ludic trains in the model's float32 without activation checkpointing; GRPOConfig
        # defaults to bf16 autocast (slow on a CPU without bf16 units) and checkpointing
        bf16=False,
        gradient_checkpointing=False,
        max_steps=args.steps,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(args.folder),
    )
    output = trainer.train()
    (Path(args.workdir) / "train_runtime.json").write_text(json.dumps(output.metrics))
    if args.save is not None:
        trainer.save_model(str(args.save))
        (args.save / "train_runtime.json").write_text(json.dumps(output.metrics))


def _demo_env_kwargs() -> dict:
    import yaml

    return dict(yaml.safe_load(DEMO.read_text())["env"]["kwargs"])


# ----------------------------------------------------------------------------- the runs
def run_timed(command: list[str], cores: str, log: Path) -> float:
    """Wall seconds of ``command`` pinned to ``cores``; fails loudly on an error."""
    # Each side picks its own torch threads, as a user's run would (torch: one per usable
    # core; ludic: one fewer, see ludic.run.threads).
    drop = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(
            ["taskset", "-c", cores, *command], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])}... failed (rc {done.returncode}); see {log}")
    return elapsed


WAIT_STAGES = ("template", "sample", "env", "parser", "credit")
"""The stages of ludic.timing that run while the trainer waits for its batch."""


def step_split(run_dirs) -> dict[str, float]:
    """Mean ms per step of ludic's step parts over the steps after the fifth of the runs
    in ``run_dirs`` (their ``metrics.jsonl``)."""
    rows = []
    for run_dir in run_dirs:
        for path in Path(run_dir).glob("**/metrics.jsonl"):
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            rows += [r for r in lines if "time/wait_s" in r and r.get("step", 0) > 5]
    if not rows:
        raise SystemExit(f"no step metrics under {run_dirs}")

    def mean_ms(key: str) -> float:
        return round(1e3 * statistics.fmean(r.get(key, 0.0) for r in rows), 1)

    split = {"wait": mean_ms("time/wait_s")}
    split |= {stage: mean_ms(f"time/stage/{stage}_s") for stage in WAIT_STAGES}
    split["rest of the wait"] = round(split["wait"] - sum(split[s] for s in WAIT_STAGES), 1)
    split["update"] = mean_ms("time/train_s")
    split["sync"] = mean_ms("time/sync_s")
    split["logging"] = mean_ms("time/stage/logging_s")
    split["checkpoint"] = mean_ms("time/stage/checkpoint_s")
    split["step"] = mean_ms("time/step_s")
    parts = ("wait", "update", "sync", "logging", "checkpoint")
    split["rest of the step"] = round(split["step"] - sum(split[k] for k in parts), 1)
    return split


def in_loop_seconds(name: str, out: Path) -> float:
    """The seconds a run spent in its training loop: ludic's ``time/step_s`` summed over its
    RL steps (each step log to log), TRL's ``train_runtime``."""
    if name == "trl":
        return float(json.loads((out / "train_runtime.json").read_text())["train_runtime"])
    (path,) = out.glob("**/metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sum(float(r["time/step_s"]) for r in rows if r.get("phase") == "rl")


GRPO_CREDIT = "algorithm.negative_group_coef=0"
"""GRPO's advantages, as TRL computes them: the demo config's negative_group_coef gives a
group whose samples all fail a negative advantage, which TRL's GRPOTrainer has no setting for."""


def ludic_command(folder: Path, out: Path, steps: int, args: argparse.Namespace) -> list[str]:
    return [
        str(Path(sys.executable).parent / "ludic"),
        "train",
        str(DEMO),
        f"output_dir={out}",
        f"model.path={folder}",
        "warm_start.steps=0",
        f"trainer.steps={steps}",
        f"trainer.prompts_per_step={args.prompts}",
        f"algorithm.group_size={args.group}",
        f"sampling.max_tokens={args.new_tokens}",
        "sampling.temperature=1.0",
        "trainer.lr=1e-4",
        "eval.every=0",  # the demo's mid-run evaluations: TRL's run has none
        GRPO_CREDIT,
    ]


def trl_command(folder: Path, out: Path, steps: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "trl",
        str(folder),
        str(out),
        f"--steps={steps}",
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--new-tokens={args.new_tokens}",
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "trl":
        return trl_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "accuracy":
        return accuracy_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "split":
        return split_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", type=int, default=5, help="steps of the short runs")
    parser.add_argument("--long", type=int, default=65, help="steps of the long runs")
    parser.add_argument("--cores", nargs="+", default=["0", "0,1"], help="taskset core lists")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--keep", type=Path, help="keep the runs' logs and outputs here")
    args = parser.parse_args()

    from ludic.models.tiny import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="vs_trl-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    folder = save_tiny_model(work / "model", hidden_size=128, num_layers=2, num_heads=2)
    print(
        f"batch {args.prompts} prompts x {args.group} samples, up to {args.new_tokens} new "
        f"tokens; step time = (run of {args.long} steps - run of {args.short}) / "
        f"{args.long - args.short}; {args.rounds} interleaved rounds"
    )
    commands = {"ludic": ludic_command, "trl": trl_command}
    for name, command in commands.items():  # warm-up (caches, compiled files): not timed
        out = work / f"{name}-warmup"
        out.mkdir(exist_ok=True)
        run_timed(command(folder, out, args.short, args), args.cores[-1], out / "log.txt")
    results = {}
    extra = args.long - args.short
    for cores in args.cores:
        per_step: dict[str, list[float]] = {"ludic": [], "trl": []}
        in_loop: dict[str, list[float]] = {"ludic": [], "trl": []}
        for round_ in range(args.rounds):
            walls: dict[tuple[str, int], float] = {}
            loops: dict[tuple[str, int], float] = {}
            for steps in (args.short, args.long):
                for name, command in commands.items():
                    out = work / f"{name}-c{cores.replace(',', '_')}-r{round_}-{steps}"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    walls[name, steps] = run_timed(
                        command(folder, out, steps, args), cores, out / "log.txt"
                    )
                    loops[name, steps] = in_loop_seconds(name, out)
            for name in commands:
                per_step[name].append((walls[name, args.long] - walls[name, args.short]) / extra)
                in_loop[name].append((loops[name, args.long] - loops[name, args.short]) / extra)
            print(
                f"cores {cores} round {round_}: wall: ludic {per_step['ludic'][-1] * 1e3:.0f} "
                f"ms/step, TRL {per_step['trl'][-1] * 1e3:.0f} ms/step; in the training loop: "
                f"ludic {in_loop['ludic'][-1] * 1e3:.0f}, TRL {in_loop['trl'][-1] * 1e3:.0f} "
                f"(load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
        split = step_split(work.glob(f"ludic-c{cores.replace(',', '_')}-r*-{args.long}"))
        print(
            f"cores {cores}: ludic's step, mean ms: "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in split.items()),
            flush=True,
        )
        ratios = [a / b for a, b in zip(per_step["ludic"], per_step["trl"])]
        loop_ratios = [a / b for a, b in zip(in_loop["ludic"], in_loop["trl"])]
        results[cores] = {
            "ludic_ms": [round(t * 1e3, 1) for t in per_step["ludic"]],
            "trl_ms": [round(t * 1e3, 1) for t in per_step["trl"]],
            "ratio_median": round(statistics.median(ratios), 3),
            "ludic_loop_ms": [round(t * 1e3, 1) for t in in_loop["ludic"]],
            "trl_loop_ms": [round(t * 1e3, 1) for t in in_loop["trl"]],
            "loop_ratio_median": round(statistics.median(loop_ratios), 3),
            "ludic_split_ms": split,
        }
        print(
            f"cores {cores}: ludic step / TRL step = {statistics.median(ratios):.2f} "
            f"(median of {[round(r, 2) for r in ratios]}); in the training loop "
            f"{statistics.median(loop_ratios):.2f} (median of {[round(r, 2) for r in loop_ratios]})",
            flush=True,
        )
    print(json.dumps(results))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- one split
def split_main(argv: list[str]) -> None:
    """``vs_trl.py split [OVERRIDE ...]``: ludic's step split on the benchmark's batch,
    from runs of ``ludic train`` with extra config overrides (one setting at a time)."""
    parser = argparse.ArgumentParser(prog="vs_trl.py split")
    parser.add_argument("overrides", nargs="*", help="extra ludic train overrides")
    parser.add_argument("--cores", default="0,1", help="taskset core list")
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    from ludic.models.tiny import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="vs_trl_split-") as tmp:
        work = Path(tmp)
        folder = save_tiny_model(work / "model", hidden_size=128, num_layers=2, num_heads=2)
        for run in range(args.runs):
            out = work / f"run{run}"
            out.mkdir()
            command = ludic_command(folder, out, args.steps, args) + args.overrides
            run_timed(command, args.cores, out / "log.txt")
            split = step_split([out])
            print(
                f"cores {args.cores} {' '.join(args.overrides) or '(defaults)'}, run {run}: "
                + ", ".join(f"{name} {ms:.1f}" for name, ms in split.items())
                + f" (load {os.getloadavg()[0]:.2f})",
                flush=True,
            )


# ----------------------------------------------------------------------------- time to accuracy
def accuracy_main(argv: list[str]) -> None:
    """``vs_trl.py accuracy``: the demo's RL phase in ludic and in TRL from the same
    warm-started weights; the time ludic takes to reach TRL's final held-out accuracy."""
    parser = argparse.ArgumentParser(prog="vs_trl.py accuracy")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cores", default="0", help="taskset core list of every run")
    parser.add_argument("--keep", type=Path, help="keep the runs' logs and outputs here")
    args = parser.parse_args(argv)
    import yaml

    demo = yaml.safe_load(DEMO.read_text())
    steps, sampling, algorithm = demo["trainer"]["steps"], demo["sampling"], demo["algorithm"]
    work = Path(tempfile.mkdtemp(prefix="vs_trl_acc-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    ludic = str(Path(sys.executable).parent / "ludic")
    print(
        f"the demo's RL phase ({steps} steps, {demo['trainer']['prompts_per_step']} prompts x "
        f"{algorithm['group_size']} samples, temperature {sampling['temperature']}, "
        f"{sampling['max_tokens']} new tokens, lr {demo['trainer']['lr']} "
        f"{demo['trainer']['lr_schedule']}) from the demo's warm start, cores {args.cores}"
    )
    results = []
    for seed in args.seeds:
        out = work / f"seed{seed}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        # 1. the warm start: the demo's SFT phase (and one RL step), exported
        run_timed(
            [
                ludic,
                "train",
                str(DEMO),
                f"output_dir={out / 'warm'}",
                f"seed={seed}",
                "trainer.steps=1",
            ],
            args.cores,
            out / "warm.log",
        )
        warm_run = next((out / "warm").iterdir())
        warm = out / "warm_model"
        run_timed(
            [ludic, "export", str(warm_run), str(warm), "--phase", "warm_start"],
            args.cores,
            out / "export.log",
        )
        # 2. ludic's RL phase: the demo's settings, evaluated every 100 steps
        run_timed(
            [
                ludic,
                "train",
                str(DEMO),
                f"output_dir={out / 'ludic'}",
                f"seed={seed}",
                f"model.path={warm}",
                "warm_start.steps=0",
                GRPO_CREDIT,
            ],
            args.cores,
            out / "ludic.log",
        )
        curve, seconds = ludic_curve(next((out / "ludic").iterdir()))
        # 3. TRL's: the same settings; its final model evaluated by ludic eval
        trl_model = out / "trl_model"
        run_timed(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "trl",
                str(warm),
                str(out / "trl"),
                f"--steps={steps}",
                f"--prompts={demo['trainer']['prompts_per_step']}",
                f"--group={algorithm['group_size']}",
                f"--new-tokens={sampling['max_tokens']}",
                f"--temperature={sampling['temperature']}",
                f"--lr={demo['trainer']['lr']}",
                f"--lr-schedule={demo['trainer']['lr_schedule']}",
                f"--seed={seed}",
                f"--save={trl_model}",
            ],
            args.cores,
            out / "trl.log",
        )
        trl_seconds = json.loads((trl_model / "train_runtime.json").read_text())["train_runtime"]
        trl_accuracy = evaluate_folder(trl_model, seed)
        reached = next(((st, acc) for st, acc in curve if acc >= trl_accuracy), None)
        row = {
            "seed": seed,
            "trl_final_accuracy": trl_accuracy,
            "trl_seconds": round(trl_seconds, 1),
            "ludic_curve": curve,
            "ludic_seconds": round(seconds[-1][1], 1),
            "ludic_reached_at_step": reached[0] if reached else None,
            "ludic_seconds_to_reach": (round(dict(seconds)[reached[0]], 1) if reached else None),
        }
        row["ratio"] = round(row["ludic_seconds_to_reach"] / trl_seconds, 3) if reached else None
        results.append(row)
        print(
            f"seed {seed}: TRL {trl_seconds:.0f} s to {trl_accuracy:.3f}; ludic "
            + (
                f"reached it at step {reached[0]} in {row['ludic_seconds_to_reach']:.0f} s "
                f"(ratio {row['ratio']:.2f}); "
                if reached
                else "never reached it; "
            )
            + f"ludic's curve {curve} in {row['ludic_seconds']:.0f} s "
            f"(load {os.getloadavg()[0]:.2f})",
            flush=True,
        )
    print(json.dumps(results))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


def ludic_curve(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """``([(step, held-out success)], [(step, seconds of RL steps so far)])`` of a ludic
    run: the evaluations, and the steps' own time (wait, update, sync, logging,
    checkpoints; the evaluations left out, as TRL's run has none)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [
        (int(r["step"]), round(float(r["success_rate"]), 3))
        for r in rows
        if r.get("phase") == "eval"
    ]
    parts = (
        "time/wait_s",
        "time/train_s",
        "time/sync_s",
        "time/stage/logging_s",
        "time/stage/checkpoint_s",
    )
    total, seconds = 0.0, [(0, 0.0)]
    for r in rows:
        if r.get("phase") == "rl" and "time/wait_s" in r:
            total += sum(float(r.get(k, 0.0)) for k in parts)
            seconds.append((int(r["step"]), total))
    return curve, seconds


def evaluate_folder(folder: Path, seed: int) -> float:
    """The held-out greedy success of a model folder on the demo's evaluation."""
    from ludic.jobs import evaluate
    from ludic.run.loading import load_config

    config = load_config(DEMO, [f"model.path={folder}", f"seed={seed}"])
    return round(float(evaluate(config)["success_rate"]), 3)


if __name__ == "__main__":
    main()
