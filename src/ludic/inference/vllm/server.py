"""ludic's policy server: vLLM's OpenAI-compatible server plus a weight-sync control plane.

    python -m ludic.inference.vllm.server --model DIR [--host 127.0.0.1] [--port 8000] \\
        [--api-key KEY] [any vLLM engine argument]

Generation is vLLM's own ``/v1/completions`` (token-in: ``prompt`` as token ids). Every
response carries the header ``x-ludic-policy-version`` (the runtime version when the
request arrived). ludic adds the control plane below, which this module also provides to
the reward server (``ludic.inference.vllm.reward_server``: ``make_control_router``,
``install_routes``, ``prepare_args``, ``parse_args``, ``serve``):

==============================  ==========================================================
``GET  /health``                200 ``{"status": "ok", "type": "policy", "version": N}``
                                (``"reward_model"`` on the reward server)
``GET  /runtime_version``       ``{"version": N}``
``GET  /get_world_size``        ``{"world_size": W}``: inference workers (the trainer adds 1)
``POST /init_communicator``     ``TorchDistributedWeightSyncInfo`` JSON; the workers join the
                                group as ranks 1..W in the background (the trainer joins as
                                rank 0 after the reply)
``POST /update_param_batch``    a ``WeightUpdateRequest`` JSON (``to_dict``); every worker
                                receives and loads the chunk in the background
                                (``?first=true`` marks a sync's first chunk). The version
                                becomes ``request.version`` (or +1) once a ``last`` chunk is
                                loaded and no chunk of that sync failed
``POST /close_communicator``    leave the group
``POST /get_num_background_tasks``  ``{"num_background_tasks", "error_count", "last_error",
                                "version"}``: poll until 0, then compare ``error_count``
``POST /reset_prefix_cache``    drop cached KV blocks
``POST /pause``, ``/resume``    ``/pause`` aborts in-flight requests (``?mode=abort``, default;
                                or ``wait`` / ``keep``) and holds new ones until ``/resume``
``GET  /is_paused``             ``{"is_paused": bool}``
==============================  ==========================================================

Background tasks run one at a time, in arrival order; a failure is logged and recorded (the
trainer sees it in ``/get_num_background_tasks``) and the server keeps serving. Requests are
JSON only; nothing received is unpickled.

Binds 127.0.0.1 unless ``--host`` says otherwise. ``--api-key`` (or ``LUDIC_API_KEY``)
guards every ``POST`` route above and vLLM's ``/v1`` routes (``Authorization: Bearer KEY``);
``/health``, ``/runtime_version`` and ``/get_world_size`` stay open. vLLM's own key check
covers only ``/v1``-style prefixes: do not expose this server to untrusted networks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import traceback
from argparse import Namespace
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from starlette.middleware import Middleware

from ludic.distributed.weight_transfer.base import (
    TorchDistributedWeightSyncInfo,
    request_from_dict,
)
from ludic.inference.vllm.logits_processors import MAX_THINK_FQCN, THINK_TOKENS_ENV, think_token_ids

logger = logging.getLogger("ludic.inference.vllm.server")

WORKER_EXTENSION = "ludic.inference.vllm.worker.WeightSyncWorkerExtension"
API_KEY_ENV = "LUDIC_API_KEY"
VERSION_HEADER = "x-ludic-policy-version"
SERVER_TYPES = ("policy", "reward_model")
"""What ``GET /health`` reports as ``type``: which ludic server answers on a port."""


# ------------------------------------------------------------------------------ state
@dataclass
class ControlState:
    """The control plane's state (lives in the API-server process)."""

    version: int = 0
    communicator: bool = False  # init_communicator requested and not closed
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one background task at a time
    error_count: int = 0
    last_error: str | None = None
    sync_failed: bool = False  # a chunk of the current sync failed: no version bump

    def record_error(self, what: str, err: BaseException) -> None:
        self.error_count += 1
        self.last_error = f"{what}: {type(err).__name__}: {err}"
        logger.error("%s failed:\n%s", what, "".join(traceback.format_exception(err)))

    def status(self) -> dict[str, Any]:
        return {
            "num_background_tasks": len(self.tasks),
            "error_count": self.error_count,
            "last_error": self.last_error,
            "version": self.version,
        }


def start_background(state: ControlState, what: str, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work`` after every earlier background task; record its failure."""

    async def run() -> None:
        async with state.lock:
            try:
                await work()
            except Exception as e:
                state.record_error(what, e)

    task = asyncio.get_running_loop().create_task(run())
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)


# ------------------------------------------------------------------------------ routes
def api_key_guard(api_key: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency that answers 401 unless the request carries
    ``Authorization: Bearer api_key`` (a no-op when ``api_key`` is ``None``)."""

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token, api_key):
            raise HTTPException(
                HTTPStatus.UNAUTHORIZED, "missing or wrong API key (Authorization: Bearer KEY)"
            )

    return check_key


def make_control_router(
    engine: Any, state: ControlState, api_key: str | None, server_type: str = "policy"
) -> APIRouter:
    """ludic's control routes on ``engine`` (a vLLM ``EngineClient``); ``/health`` reports
    ``server_type`` (one of :data:`SERVER_TYPES`)."""
    if server_type not in SERVER_TYPES:
        raise ValueError(f"server_type={server_type!r}; expected one of {SERVER_TYPES}")
    guarded = APIRouter(dependencies=[Depends(api_key_guard(api_key))])
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        try:
            await engine.check_health()
        except Exception as e:
            return JSONResponse(
                {"status": "error", "error": str(e)}, HTTPStatus.SERVICE_UNAVAILABLE
            )
        return JSONResponse({"status": "ok", "type": server_type, "version": state.version})

    @router.get("/runtime_version")
    async def runtime_version() -> dict[str, int]:
        return {"version": state.version}

    @router.get("/get_world_size")
    async def get_world_size() -> dict[str, int]:
        return {"world_size": num_workers(engine)}

    @guarded.post("/init_communicator")
    async def init_communicator(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        try:
            info = TorchDistributedWeightSyncInfo(**body)
        except (TypeError, ValueError) as e:
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"bad sync info: {e}") from None
        workers = num_workers(engine)
        if info.world_size != workers + 1:
            raise HTTPException(
                HTTPStatus.BAD_REQUEST,
                f"world_size={info.world_size}, but this server has {workers} worker(s): "
                f"use world_size={workers + 1} (GET /get_world_size, plus the trainer)",
            )
        state.communicator = True

        async def work() -> None:
            await engine.collective_rpc("init_communicator", args=(info.to_dict(), 1))

        start_background(state, "init_communicator", work)
        return {"status": "ok", "error_count": state.error_count}

    @guarded.post("/update_param_batch")
    async def update_param_batch(request: Request, first: bool = Query(False)) -> dict[str, Any]:
        body = await json_body(request)
        try:
            update = request_from_dict(body)
        except ValueError as e:
            raise HTTPException(HTTPStatus.BAD_REQUEST, str(e)) from None
        if not state.communicator:
            raise HTTPException(
                HTTPStatus.CONFLICT, "no weight-sync group: POST /init_communicator first"
            )
        payload = update.to_dict()

        async def work() -> None:
            if first:
                state.sync_failed = False
            try:
                await engine.collective_rpc("update_param_batch", args=(payload, first))
            except Exception:
                state.sync_failed = True
                raise
            finally:
                sync_ok = not state.sync_failed
                if update.last:  # the sync is over, whatever happened
                    state.sync_failed = False
            if update.last and sync_ok:
                await engine.reset_prefix_cache()
                state.version = update.version if update.version is not None else state.version + 1
                logger.info("weights updated: runtime version %d", state.version)

        by_id = getattr(update, "is_reference", False)  # broadcast requests only
        what = f"layout {update.layout}" if by_id else f"{len(update.names)} tensors"
        start_background(state, f"update_param_batch({what})", work)
        return {"status": "ok", "error_count": state.error_count}

    @guarded.post("/close_communicator")
    async def close_communicator() -> dict[str, str]:
        async with state.lock:  # after every pending transfer
            state.communicator = False
            await engine.collective_rpc("close_communicator")
        return {"status": "ok"}

    @guarded.post("/get_num_background_tasks")
    async def get_num_background_tasks() -> dict[str, Any]:
        return state.status()

    @guarded.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        return {"success": bool(await engine.reset_prefix_cache())}

    @guarded.post("/pause")
    async def pause(mode: str = Query("abort")) -> JSONResponse:
        if mode not in ("abort", "wait", "keep"):
            raise HTTPException(
                HTTPStatus.BAD_REQUEST, f"mode={mode!r}; expected abort, wait or keep"
            )
        await engine.pause_generation(mode=mode)
        return JSONResponse({"status": "paused", "mode": mode})

    @guarded.post("/resume")
    async def resume() -> dict[str, str]:
        await engine.resume_generation()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": bool(await engine.is_paused())}

    router.include_router(guarded)
    return router


async def json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError:
        raise HTTPException(HTTPStatus.BAD_REQUEST, "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
    return body


def num_workers(engine: Any) -> int:
    return int(engine.vllm_config.parallel_config.world_size)


def install_routes(app: FastAPI, router: APIRouter, state: ControlState) -> None:
    """Add ``router``, replacing vLLM routes with the same path (e.g. ``/health``), and
    tag every response with the runtime version."""
    ours = {getattr(r, "path", None) for r in router.routes}
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in ours]
    app.include_router(router)
    # vLLM's app has already built its middleware stack (as vLLM's own bootstrap does,
    # add ours as the outermost layer and rebuild).
    app.user_middleware.insert(0, Middleware(VersionHeaderMiddleware, state=state))
    app.middleware_stack = app.build_middleware_stack()


class VersionHeaderMiddleware:
    """Adds ``x-ludic-policy-version``: the runtime version when the request arrived."""

    def __init__(self, app: Any, state: ControlState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        version = str(self.state.version).encode()

        async def send_with_version(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (VERSION_HEADER.encode(), version)]
            await send(message)

        await self.app(scope, receive, send_with_version)


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
    host, the API key (``--api-key`` or ``LUDIC_API_KEY``), one data-parallel engine and
    ludic's weight-sync worker extension."""
    if args.model_tag is not None:
        args.model = args.model_tag
    if not args.host:
        args.host = "127.0.0.1"
    key = (args.api_key or [None])[0] or os.environ.get(API_KEY_ENV) or None
    args.api_key = [key] if key else None
    if getattr(args, "data_parallel_size", 1) != 1:
        raise SystemExit(
            "ludic's vLLM servers need data_parallel_size=1 (weight sync addresses one "
            "engine); start one server per data-parallel replica"
        )
    if args.worker_extension_cls in (None, ""):
        args.worker_extension_cls = WORKER_EXTENSION
    return args


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
    return prepare_args(parser.parse_args(argv))


def serve(
    args: Namespace, *, server_type: str, extra_routers: Sequence[RouterFactory] = ()
) -> None:
    """Validate ``args`` as vLLM does and serve until shut down (blocks)."""
    import uvloop
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    validate_parsed_serve_args(args)
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

    api_key = args.api_key[0] if args.api_key else None
    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as engine:
        supported_tasks = await engine.get_supported_tasks()
        app = build_app(args, supported_tasks, engine.model_config)
        await init_app_state(engine, app.state, args, supported_tasks)
        state = ControlState()
        router = make_control_router(engine, state, api_key, server_type)
        context = ServerContext(engine, state, args, tuple(supported_tasks), api_key)
        for make_router in extra_routers:
            router.include_router(make_router(context))
        install_routes(app, router, state)
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


def main(argv: list[str] | None = None) -> None:
    """``python -m ludic.inference.vllm.server``: the policy server."""
    args = add_max_think(parse_args(argv, __doc__.split("\n")[0]))
    export_think_tokens(args)
    serve(args, server_type="policy")


if __name__ == "__main__":
    main()
