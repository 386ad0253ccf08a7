"""ludic's policy server: vLLM's OpenAI-compatible server plus a weight-sync control plane.

    python -m ludic.inference.vllm.server --model DIR [--host 127.0.0.1] [--port 8000] \\
        [--api-key KEY] [any vLLM engine argument]        # or: ludic serve policy

Generation is vLLM's token-in ``/v1/completions``, its logprobs those of the distribution each
token was drawn from (:data:`SAMPLED_LOGPROBS_MODE`), with ludic's version headers
(``admission``). The control routes (``control``; table in docs/real-model.md) and security
(``security``) are shared with ``reward_server`` (``make_control_router``, ``serve``, ...).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from argparse import Namespace
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.middleware import Middleware

from ludic.inference.vllm.admission import VersionHeaderMiddleware
from ludic.inference.vllm.control import (
    SERVER_TYPES,
    ControlPolicy,
    ControlState,
    json_body,
    make_control_router,
)
from ludic.inference.vllm.http import VERSION_HEADER
from ludic.inference.vllm.logits_processors import MAX_THINK_FQCN, THINK_TOKENS_ENV, think_token_ids
from ludic.inference.vllm.process import CPU_DEFAULT_ENV, _flag_name, cpu_default_args
from ludic.inference.vllm.security import (
    API_KEY_ENV,
    DEFAULT_SYNC_TIMEOUT_CAP_S,
    ApiKeyMiddleware,
    check_bind,
    start_parent_watchdog,
)
from ludic.inference.vllm.versions import TESTED_VLLM, check_vllm_version

__all__ = [
    "API_KEY_ENV",
    "SERVER_TYPES",
    "VERSION_HEADER",
    "ControlPolicy",
    "ControlState",
    "ServerContext",
    "install_routes",
    "json_body",
    "main",
    "make_control_router",
    "parse_args",
    "prepare_args",
    "serve",
]

logger = logging.getLogger("ludic.inference.vllm.server")

WORKER_EXTENSION = "ludic.inference.vllm.worker.WeightSyncWorkerExtension"


def install_routes(
    app: FastAPI, router: APIRouter, state: ControlState, api_key: str | None = None
) -> None:
    """Add ``router``, replacing vLLM routes with the same path (e.g. ``/health``), tag
    every response with its policy versions (:class:`VersionHeaderMiddleware`) and, with
    ``api_key``, require it on every route but ``/health``
    (:class:`~ludic.inference.vllm.security.ApiKeyMiddleware`)."""
    ours = {getattr(r, "path", None) for r in router.routes}
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in ours]
    app.include_router(router)
    # vLLM's app has already built its middleware stack (as vLLM's own bootstrap does,
    # add ours as the outermost layer and rebuild).
    app.user_middleware.insert(0, Middleware(VersionHeaderMiddleware, state=state))
    if api_key:  # outermost: nothing runs before the key is checked
        app.user_middleware.insert(0, Middleware(ApiKeyMiddleware, api_key=api_key))
    app.middleware_stack = app.build_middleware_stack()


# ------------------------------------------------------------------------------ main
@dataclass(frozen=True)
class ServerContext:
    """What a server-specific router is built from, once the engine is up."""

    engine: Any  # a vLLM EngineClient (AsyncLLM)
    state: ControlState
    args: Namespace  # after prepare_args
    supported_tasks: tuple[str, ...]  # the engine's tasks, e.g. ("classify",)
    api_key: str | None


RouterFactory = Callable[[ServerContext], APIRouter]
"""Builds a server's own routes (e.g. the reward server's ``/score``); they replace vLLM
routes with the same path. May raise to refuse a model the server cannot serve."""


def prepare_args(args: Namespace) -> Namespace:
    """ludic's defaults on vLLM's parsed arguments (both servers): the model, a local
    host, the API key (``--api-key`` or ``LUDIC_API_KEY``; kept in ``args.ludic_api_key``
    and checked by ludic's middleware, not handed to vLLM), the host/key check, the
    weight-sync limits, one data-parallel engine and ludic's weight-sync worker
    extension."""
    if args.model_tag is not None:
        args.model = args.model_tag
    if not args.host:
        args.host = "127.0.0.1"
    args.ludic_api_key = (args.api_key or [None])[0] or os.environ.get(API_KEY_ENV) or None
    args.api_key = None  # vLLM's own check covers /v1 only; ours covers every route
    check_bind(args.host, args.ludic_api_key, getattr(args, "allow_insecure", False))
    hosts = getattr(args, "weight_sync_hosts", None) or ""
    roots = getattr(args, "weight_load_roots", None) or ""
    args.control_policy = ControlPolicy(
        sync_hosts=tuple(h.strip() for h in hosts.split(",") if h.strip()),
        timeout_cap_s=getattr(args, "weight_sync_timeout_cap", DEFAULT_SYNC_TIMEOUT_CAP_S),
        load_roots=tuple(r.strip() for r in roots.split(",") if r.strip()),
    )
    if getattr(args, "data_parallel_size", 1) != 1:
        raise SystemExit(
            "ludic's vLLM servers need data_parallel_size=1 (weight sync addresses one "
            "engine); start one server per data-parallel replica"
        )
    if args.worker_extension_cls in (None, ""):
        args.worker_extension_cls = WORKER_EXTENSION
    if getattr(args, "lora_rank", None):
        args.enable_lora = True
        args.max_lora_rank = lora_rank_slot(args.lora_rank)
    import vllm

    check_vllm_version(vllm.__version__, allow_untested=getattr(args, "allow_untested_vllm", False))
    return args


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's allowed ``--max-lora-rank`` values."""


def lora_rank_slot(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if rank <= slot:
            return slot
    raise SystemExit(f"--lora-rank {rank}: vLLM serves LoRA ranks up to {LORA_RANK_SLOTS[-1]}")


def add_max_think(args: Namespace) -> Namespace:
    """The policy server's logits processor for ``max_think`` (see
    ``ludic.inference.vllm.logits_processors``), added once."""
    processors = list(args.logits_processors or [])
    if MAX_THINK_FQCN not in processors:
        processors.append(MAX_THINK_FQCN)
    args.logits_processors = processors
    return args


def export_think_tokens(args: Namespace) -> None:
    """Resolve ``<think>``/``</think>`` once here; the engine's workers inherit the env."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer or args.model, trust_remote_code=args.trust_remote_code
    )
    os.environ[THINK_TOKENS_ENV] = json.dumps(think_token_ids(tokenizer))


def parse_args(argv: list[str] | None, description: str) -> Namespace:
    """vLLM's serve arguments (``--model``, ``--host``, ``--port``, ``--api-key``, every
    engine argument) with :func:`prepare_args` applied."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description=description))
    add_ludic_args(parser)
    if argv is None:
        argv = sys.argv[1:]
    return prepare_args(parser.parse_args(with_cpu_defaults(list(argv))))


def add_ludic_args(parser: Any) -> None:
    """ludic's own server options (security and weight-sync limits)."""
    group = parser.add_argument_group("ludic")
    group.add_argument(
        "--allow-insecure",
        action="store_true",
        help="serve on a non-loopback --host without an API key (a loud warning instead of "
        "a refusal)",
    )
    group.add_argument(
        "--allow-untested-vllm",
        action="store_true",
        help=f"start on a vLLM release outside the tested range ({TESTED_VLLM}), with a warning",
    )
    group.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="take adapter-only LoRA syncs of rank up to R (vLLM's --enable-lora with "
        "--max-lora-rank the smallest allowed value >= R); 0: full-weight syncs only",
    )
    group.add_argument(
        "--weight-sync-hosts",
        default="",
        metavar="HOST[,HOST...]",
        help="master_addr values /init_communicator accepts besides loopback (a trainer on "
        "another machine)",
    )
    group.add_argument(
        "--weight-load-roots",
        default="",
        metavar="DIR[,DIR...]",
        help="folders whose policy folders POST /load_weights_from_disk may load (e.g. a "
        "run directory); none: the route is refused",
    )
    group.add_argument(
        "--weight-sync-timeout-cap",
        type=float,
        default=DEFAULT_SYNC_TIMEOUT_CAP_S,
        metavar="SECONDS",
        help="largest timeout_s a weight-sync group may ask for (default %(default)s)",
    )


def with_cpu_defaults(argv: list[str]) -> list[str]:
    """On a machine without CUDA, ``ludic train``'s CPU defaults (eager mode, no
    compilation, float32, a 1 GiB KV cache) for whatever ``argv`` does not set."""
    from ludic.inference.vllm.process import _cuda_available

    if _cuda_available():
        return argv
    for name, value in CPU_DEFAULT_ENV.items():
        os.environ.setdefault(name, value)
    return [*cpu_default_args(argv), *argv]


def serve(
    args: Namespace, *, server_type: str, extra_routers: Sequence[RouterFactory] = ()
) -> None:
    """Validate ``args`` as vLLM does and serve until shut down (blocks)."""
    import uvloop
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    validate_parsed_serve_args(args)
    start_parent_watchdog()  # no-op unless LUDIC_PARENT_PID names the starting process
    uvloop.run(run_server(args, server_type=server_type, extra_routers=extra_routers))


async def run_server(
    args: Namespace,
    *,
    server_type: str = "policy",
    extra_routers: Sequence[RouterFactory] = (),
) -> None:
    """vLLM's ``run_server`` with ludic's control routes (and ``extra_routers``) added
    before serving."""
    import vllm.envs as vllm_envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    api_key = getattr(args, "ludic_api_key", None)
    policy = getattr(args, "control_policy", ControlPolicy())
    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as engine:
        supported_tasks = await engine.get_supported_tasks()
        app = build_app(args, supported_tasks, engine.model_config)
        await init_app_state(engine, app.state, args, supported_tasks)
        state = ControlState()
        # this engine instance's adds pass the admission gate and record their version
        state.gate.install(engine, lambda: state.version)
        router = make_control_router(engine, state, server_type, policy)
        context = ServerContext(engine, state, args, tuple(supported_tasks), api_key)
        for make_router in extra_routers:
            router.include_router(make_router(context))
        install_routes(app, router, state, api_key)
        logger.info("ludic %s server on %s", server_type, listen_address)
        shutdown_task = await serve_http(
            app,
            sock=sock,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=vllm_envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
        )
    try:
        await shutdown_task
    finally:
        sock.close()


SAMPLED_LOGPROBS_MODE = "processed_logprobs"
"""vLLM's ``--logprobs-mode`` on the policy server: a sampled token's logprob under the
distribution it was drawn from (after temperature, top-k and top-p; greedy requests: of the
raw logits), the policy the trainer scores at ``TokenTrace.logprob_temperature``. vLLM's
default (``raw_logprobs``, before temperature) would give behaviour logprobs of another
policy than the one that sampled whenever the temperature is not 1."""


def sampled_logprobs_mode(args: Namespace, argv: Sequence[str]) -> Namespace:
    """Set :data:`SAMPLED_LOGPROBS_MODE`; a ``--logprobs-mode`` in ``argv`` naming another
    mode is refused (the trainer would score another policy than the sampler's)."""
    if _flag_given(argv, "--logprobs-mode") and args.logprobs_mode != SAMPLED_LOGPROBS_MODE:
        raise SystemExit(
            f"--logprobs-mode {args.logprobs_mode}: ludic's policy server returns "
            f"{SAMPLED_LOGPROBS_MODE} (the logprobs of the distribution each token was drawn "
            "from, which the trainer scores at the request's temperature); drop the flag"
        )
    args.logprobs_mode = SAMPLED_LOGPROBS_MODE
    return args


def requested_sampling_only(args: Namespace, argv: Sequence[str]) -> Namespace:
    """``--generation-config vllm`` unless ``argv`` names one: vLLM otherwise fills the
    sampling settings a request leaves out (ludic sends no ``top_k`` of -1, no repetition
    penalty) from the model folder's ``generation_config.json`` (e.g. ``top_k: 20``,
    ``repetition_penalty: 1.05``), which the request never asked for, the in-process
    backend does not apply, and the processed logprobs would then carry."""
    if not _flag_given(argv, "--generation-config"):
        args.generation_config = "vllm"
    return args


def _flag_given(argv: Sequence[str], flag: str) -> bool:
    """``flag`` (as ``--flag value`` or ``--flag=value``) is in ``argv``."""
    return any(_flag_name(a) == flag for a in argv if a.startswith("--"))


def main(argv: list[str] | None = None) -> None:
    """``python -m ludic.inference.vllm.server``: the policy server."""
    argv = sys.argv[1:] if argv is None else argv
    args = add_max_think(parse_args(argv, __doc__.split("\n")[0]))
    sampled_logprobs_mode(args, argv)
    requested_sampling_only(args, argv)
    export_think_tokens(args)
    serve(args, server_type="policy")


if __name__ == "__main__":
    main()
