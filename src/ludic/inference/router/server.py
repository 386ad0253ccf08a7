"""``ludic serve router``: the router as a process, and :func:`start_router` to run one
as a subprocess (as ``ludic train`` does for its reward servers).

    ludic serve router --backend URL [--backend URL ...] [--host 127.0.0.1] [--port 8000] \\
        [--api-key KEY] [--health-interval-s 2]

The router's key (``--api-key`` or ``LUDIC_API_KEY``) guards every route but ``/health``; a
non-loopback ``--host`` without one is refused unless ``--allow-insecure``. The backends get
``LUDIC_BACKEND_API_KEY``, else the router's key (keys stay off the command line).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from ludic.distributed.weight_transfer.groups import free_port
from ludic.inference.router.app import RouterApp
from ludic.inference.router.pool import Backend, BackendPool, backend_url
from ludic.inference.vllm.process import VLLMServerProcess, launch_server
from ludic.inference.vllm.security import (
    API_KEY_ENV,
    ApiKeyMiddleware,
    check_bind,
    start_parent_watchdog,
)

BACKEND_API_KEY_ENV = "LUDIC_BACKEND_API_KEY"
"""Environment variable holding the key the router sends to its backends."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The router's arguments; a bad one (e.g. a ``--backend`` that is not a URL) is a
    usage error: argparse's message, exit code 2."""
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ludic serve router",
        description="One address over N inference servers: least-in-flight load "
        "balancing, health checks, retry on another backend.",
    )
    parser.add_argument(
        "--backend",
        action="append",
        required=True,
        type=_backend_arg,
        metavar="URL",
        help="a server's base URL, http(s)://host:port (repeat for each server)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"key every route but /health needs (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--allow-insecure", action="store_true")
    parser.add_argument("--health-interval-s", type=float, default=2.0)
    parser.add_argument("--health-timeout-s", type=float, default=5.0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


def _backend_arg(url: str) -> str:
    try:
        return backend_url(url)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_app(args: argparse.Namespace) -> object:
    """The ASGI app for parsed ``args`` (the key check wrapped around the router)."""
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    backend_key = os.environ.get(BACKEND_API_KEY_ENV) or api_key
    pool = BackendPool(
        [Backend(url, api_key=backend_key) for url in args.backend],
        request_timeout_s=args.request_timeout_s,
        health_timeout_s=args.health_timeout_s,
    )
    app: object = RouterApp(pool, health_interval_s=args.health_interval_s)
    return ApiKeyMiddleware(app, api_key) if api_key else app


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError as e:
        raise SystemExit(
            f"ludic serve router needs uvicorn ({e}); pip install 'ludic-rl[router]'"
        ) from None
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(args.host, api_key, args.allow_insecure)
    try:
        app = build_app(args)
    except ValueError as e:  # e.g. a backend given twice
        _parser().error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(message)s")
    start_parent_watchdog()  # no-op unless LUDIC_PARENT_PID names the starting process
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on")


def start_router(
    backends: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    backend_api_key: str | None = None,
    health_interval_s: float = 2.0,
    request_timeout_s: float = 300.0,
    log_path: str | os.PathLike[str] | None = None,
    wait: bool = True,
    health_timeout_s: float = 60.0,
) -> VLLMServerProcess:
    """Start ``ludic serve router`` over ``backends`` as a subprocess (its own session,
    ended with this process); with ``wait``, block until it reports a healthy backend.
    ``backend_api_key`` defaults to ``api_key``. Use it as a context manager or
    ``.stop()`` it."""
    port = port or free_port(host)
    args = [sys.executable, "-m", "ludic", "serve", "router", "--host", host]
    args += ["--port", str(port), "--health-interval-s", str(health_interval_s)]
    args += ["--request-timeout-s", str(request_timeout_s), "--log-level", "warning"]
    for url in backends:
        args += ["--backend", url]
    env = {BACKEND_API_KEY_ENV: backend_api_key} if backend_api_key else {}
    return launch_server(
        args,
        kind="router",
        host=host,
        port=port,
        api_key=api_key,
        env=env,
        log_path=log_path,
        wait=wait,
        health_timeout_s=health_timeout_s,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
