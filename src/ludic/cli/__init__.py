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
import shlex
import sys
from collections.abc import Sequence

from ludic.cli.commands import demo_config_path
from ludic.cli.output import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    one_line,
    print_error,
)
from ludic.cli.parser import build_parser, take_late_overrides
from ludic.jsonl import JSONLError
from ludic.run.errors import RunError
from ludic.run.loading import ConfigError
from ludic.run.signals import EXIT_TERMINATED, Terminated
from ludic.types import ContractError

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "demo_config_path", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ludic`` command line; returns the exit code."""
    parser = build_parser()
    try:
        # parse_known_args + take_late_overrides lets overrides follow options:
        # `ludic train cfg.yaml --resume DIR trainer.lr=1e-5`.
        args, extra = parser.parse_known_args(argv)
        take_late_overrides(parser, args, extra)
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
        print_error(_interrupted_message(args))
        return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
    except Exception as err:
        if isinstance(err, _user_error_types()):
            print_error(f"error: {one_line(err)}")
            return EXIT_USAGE
        message = one_line(err)
        detail = f"{type(err).__name__}: {message}" if message else type(err).__name__
        print_error(f"error: {detail} (run with --debug for the traceback)")
        return EXIT_FAILURE


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
