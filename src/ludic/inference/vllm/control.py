"""ludic's control plane on a vLLM server (policy and reward): health, runtime version, weight
sync and its report, adapter announcements, loads from disk, prefix cache, pause/resume and
sleep/wake-up. Route table: docs/real-model.md; the API key is ``security``'s.

``/pause`` closes the admission gate (``admission``) before pausing the engine, ``/resume``
reopens it after. No operation holds the plane forever: workers join a group in a thread of
their own, every background operation is bounded by ``--weight-sync-timeout-cap`` (past it,
``/health`` is 503 ``control_plane_stuck``), and ``/close_communicator`` abandons a pending
join and waits at most :data:`LOCK_TIMEOUT_S` for the running operation (then 503).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import json
import logging
import shutil
import tempfile
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from ludic.distributed.weight_transfer.base import (
    TorchDistributedWeightSyncInfo,
    request_from_dict,
)
from ludic.distributed.weight_transfer.deadlines import stage_deadline
from ludic.inference.vllm.admission import AdmissionGate
from ludic.inference.vllm.security import (
    DEFAULT_SYNC_TIMEOUT_CAP_S,
    LoadPathRefused,
    capped_timeout,
    check_load_path,
    check_sync_address,
)

logger = logging.getLogger("ludic.inference.vllm.server")

SERVER_TYPES = ("policy", "reward_model")
"""What ``GET /health`` reports as ``type``: which ludic server answers on a port."""
LOCK_TIMEOUT_S = 10.0
"""How long ``/close_communicator`` waits for the operation holding the control plane."""
JOIN_POLL_S = (0.05, 2.0)
"""How often the server asks its workers whether they joined: from the first value,
doubling up to the second. A worker busy-spins for a second after each request, so
polling a long join (a group spanning several servers) every fraction of a second kept
each worker spinning a whole core, starving the others on a small machine."""
GRACE_S = 5.0  # on top of the cap: the engine round trips around a worker's own timeout
IPC_STRATEGIES = ("cuda_ipc", "packed_cuda_ipc")
"""``/init_communicator`` strategies for a trainer sharing this server's GPU."""
WAKE_TAGS = ("weights", "kv_cache")
TAGS_QUERY = Query(None)  # ?tags=weights&tags=kv_cache
PAUSE_MODES = ("abort", "wait", "keep")
"""``/pause?mode=``: abort in-flight requests (the publish cycle), wait for them to finish,
or keep them frozen until ``/resume``."""


@dataclass(frozen=True)
class ControlPolicy:
    """Server-side limits of the control plane (from ``--weight-sync-hosts`` and
    ``--weight-sync-timeout-cap``)."""

    sync_hosts: tuple[str, ...] = ()
    timeout_cap_s: float = DEFAULT_SYNC_TIMEOUT_CAP_S
    load_roots: tuple[str, ...] = ()
    """Folders ``/load_weights_from_disk`` may load from (``--weight-load-roots``); none:
    the route is refused (403)."""

    def __post_init__(self) -> None:
        if not self.timeout_cap_s > 0:
            raise ValueError(
                f"--weight-sync-timeout-cap={self.timeout_cap_s}; need a positive number of seconds"
            )


# ------------------------------------------------------------------------------ state
@dataclass
class ControlState:
    """The control plane's state (lives in the API-server process)."""

    version: int = 0
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Fresh at every start: a trainer that sees it change knows the server restarted (and
    lost the weights it synced)."""
    communicator: bool = False  # init_communicator requested and not closed
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one background task at a time
    error_count: int = 0
    last_error: str | None = None
    sync_failed: bool = False  # a chunk of the current sync failed: no version bump
    sync_bytes: int = 0  # bytes of the current sync (its trainer says so in the first chunk)
    join_task: asyncio.Task[None] | None = None  # a pending /init_communicator
    busy: dict[object, tuple[str, float, float]] = field(default_factory=dict)
    """Operations in flight: token -> (what, started (monotonic), cap_s)."""
    gate: AdmissionGate = field(default_factory=AdmissionGate)
    """Open while serving; closed from ``/pause`` to ``/resume``."""
    pause_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One ``/pause`` or ``/resume`` at a time (a resume never lands inside a pause)."""
    adapter_folder: str | None = None
    """Where the workers write an adapter sync's adapter (made at the first one)."""
    adapter_next: Any = None
    """The ``LoRARequest`` a ``/lora_adapter`` announced for the next sync."""
    sync_adapter: Any = None
    """The current sync's ``LoRARequest`` (None: a full-weight sync)."""

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

    def stuck(self) -> tuple[str, float] | None:
        """The longest-running operation past its cap, as (what, seconds), if any."""
        now = time.monotonic()
        late = [(what, now - t0) for what, t0, cap in self.busy.values() if now - t0 > cap]
        return max(late, key=lambda x: x[1]) if late else None

    def holder(self) -> str:
        now = time.monotonic()
        ops = [f"{what} for {now - t0:.0f}s" for what, t0, _ in self.busy.values()]
        return ", ".join(ops) or "an operation"


async def bounded(state: ControlState, what: str, work: Awaitable[Any], cap_s: float) -> Any:
    """Await ``work`` for at most ``cap_s`` (+ grace); it is listed in ``state.busy``
    until it really ends (an engine call that outlives the wait stays listed, so
    ``/health`` reports it)."""
    task = asyncio.ensure_future(work)
    token = object()
    state.busy[token] = (what, time.monotonic(), cap_s)

    def done(t: asyncio.Future[Any]) -> None:
        state.busy.pop(token, None)
        if not t.cancelled():
            t.exception()  # retrieved: a late failure is not logged as unhandled

    task.add_done_callback(done)
    try:
        return await asyncio.wait_for(asyncio.shield(task), cap_s + GRACE_S)
    except TimeoutError:
        raise TimeoutError(f"{what} did not finish within {cap_s + GRACE_S:.0f}s") from None
    except asyncio.CancelledError:
        task.cancel()  # cancelled on purpose (e.g. /close_communicator): stop the work too
        raise


def start_background(
    state: ControlState, what: str, work: Callable[[], Awaitable[None]], cap_s: float
) -> asyncio.Task[None]:
    """Run ``work`` after every earlier background task, for at most ``cap_s``; record
    its failure."""

    async def run() -> None:
        async with state.lock:
            try:
                await bounded(state, what, work(), cap_s)
            except Exception as e:
                state.record_error(what, e)

    task = asyncio.get_running_loop().create_task(run())
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)
    return task


# ------------------------------------------------------------------------------ routes
ROUTES = {
    "GET": "health runtime_version weight_report get_world_size is_paused is_sleeping admission",
    "POST": "init_communicator update_param_batch load_weights_from_disk lora_adapter "
    "close_communicator get_num_background_tasks reset_prefix_cache pause resume sleep wake_up",
}
"""ludic's control routes by method: route ``/NAME`` is :class:`ControlRoutes`' ``NAME``."""


def make_control_router(
    engine: Any,
    state: ControlState,
    server_type: str = "policy",
    policy: ControlPolicy = ControlPolicy(),
) -> APIRouter:
    """ludic's control routes on ``engine`` (a vLLM ``EngineClient``); ``/health`` reports
    ``server_type`` (one of :data:`SERVER_TYPES`). The API key is checked by the app's
    middleware (``ludic.inference.vllm.security.ApiKeyMiddleware``), not here."""
    if server_type not in SERVER_TYPES:
        raise ValueError(f"server_type={server_type!r}; expected one of {SERVER_TYPES}")
    routes = ControlRoutes(engine, state, server_type, policy)
    router = APIRouter()
    for method, names in ROUTES.items():
        for name in names.split():
            router.add_api_route(f"/{name}", getattr(routes, name), methods=[method])
    return router


class ControlRoutes:
    """The handlers of :data:`ROUTES` on ``engine``, sharing ``state`` and ``policy``."""

    def __init__(
        self, engine: Any, state: ControlState, server_type: str, policy: ControlPolicy
    ) -> None:
        self.engine, self.state, self.server_type = engine, state, server_type
        self.policy, self.cap = policy, policy.timeout_cap_s

    async def health(self) -> JSONResponse:
        try:
            await self.engine.check_health()
        except Exception as e:
            return JSONResponse(
                {"status": "error", "error": str(e)}, HTTPStatus.SERVICE_UNAVAILABLE
            )
        state = self.state
        if (stuck := state.stuck()) is not None:
            return JSONResponse(
                {"status": "control_plane_stuck", "operation": stuck[0], "busy_for_s": stuck[1]},
                HTTPStatus.SERVICE_UNAVAILABLE,
            )
        ok = dict(status="ok", type=self.server_type, version=state.version, boot_id=state.boot_id)
        return JSONResponse(ok)

    async def runtime_version(self) -> dict[str, int]:
        return {"version": self.state.version}

    async def weight_report(self) -> dict[str, Any]:
        """Each worker's report of the last sync it loaded (the sums of what it received
        and of what it loaded; ``ludic.inference.vllm.load_report``), with the runtime
        version and this server's boot id."""
        rpc, state = self.engine.collective_rpc("weight_report"), self.state
        workers = await bounded(state, "weight_report", rpc, self.cap)
        dtype = str(self.engine.vllm_config.model_config.dtype).removeprefix("torch.")
        return dict(version=state.version, boot_id=state.boot_id, dtype=dtype, workers=workers)

    async def get_world_size(self) -> dict[str, int]:
        return {"world_size": num_workers(self.engine)}

    async def get_num_background_tasks(self, report: bool = Query(False)) -> dict[str, Any]:
        """The control plane's status; with ``report=true`` and no task left, also the
        weight report (``/weight_report``): a trainer waiting for a sync to be applied gets
        it with its last poll."""
        status = self.state.status()
        if report and not self.state.tasks:
            status["report"] = await self.weight_report()
        return status

    async def init_communicator(self, request: Request) -> dict[str, Any]:
        body = await json_body(request)
        strategy = body.pop("strategy", "broadcast")
        if strategy in IPC_STRATEGIES:
            return await self._init_ipc(strategy, body)
        if strategy != "broadcast":
            raise HTTPException(
                HTTPStatus.BAD_REQUEST,
                f"strategy={str(strategy)[:64]!r}; expected 'broadcast' or one of {IPC_STRATEGIES}",
            )
        try:
            info = TorchDistributedWeightSyncInfo(**body)
            check_sync_address(info.master_addr, self.policy.sync_hosts)
        except (TypeError, ValueError) as e:
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"bad sync info: {e}") from None
        workers = num_workers(self.engine)
        if info.rank_offset + workers > info.world_size:
            raise HTTPException(
                HTTPStatus.BAD_REQUEST,
                f"world_size={info.world_size} with rank_offset={info.rank_offset}, but this "
                f"server has {workers} worker(s): use world_size >= {info.rank_offset + workers} "
                "(GET /get_world_size gives each server's workers; add the trainer)",
            )
        info = replace(info, timeout_s=capped_timeout(info.timeout_s, self.cap))
        self.state.communicator = True
        work = functools.partial(join_group, self.engine, info)
        self.state.join_task = start_background(
            self.state, "init_communicator", work, info.timeout_s
        )
        return {"status": "ok", "error_count": self.state.error_count, "timeout_s": info.timeout_s}

    async def _init_ipc(self, strategy: str, body: dict[str, Any]) -> dict[str, Any]:
        """CUDA IPC (colocated trainer): no group to join; each worker builds the receiver
        that opens the handles the trainer's requests carry. Refused unless the server runs
        on CUDA (the handles are GPU memory of this machine)."""
        if body:
            raise HTTPException(
                HTTPStatus.BAD_REQUEST,
                f"bad sync info: strategy {strategy!r} takes no other field, got {sorted(body)}",
            )
        device = device_type(self.engine)
        if device != "cuda":
            raise HTTPException(
                HTTPStatus.BAD_REQUEST,
                f"strategy {strategy!r} shares GPU memory with a trainer on this machine, but "
                f"this server runs on {device}; use the broadcast strategy",
            )
        self.state.communicator = True
        args = ({}, 0, strategy)
        work = functools.partial(self.engine.collective_rpc, "init_communicator", args=args)
        self.state.join_task = start_background(self.state, "init_communicator", work, self.cap)
        return {"status": "ok", "error_count": self.state.error_count, "timeout_s": self.cap}

    async def update_param_batch(
        self,
        request: Request,
        first: bool = Query(False),
        record: bool = Query(True),
        nbytes: int = Query(0, alias="bytes", ge=0),
    ) -> dict[str, Any]:
        """Receive and load one announced chunk (in the background). ``first`` starts a
        sync of ``bytes`` bytes: each of its chunks may take the cap plus the time those
        bytes take at the floor rate (a CPU worker loads them all with the last one);
        ``record=false``: the workers take no checksums of this sync (its trainer does not
        verify it)."""
        engine, state = self.engine, self.state
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

        if first:
            state.sync_bytes = nbytes
            state.sync_adapter, state.adapter_next = state.adapter_next, None
        adapter = state.sync_adapter

        async def work() -> None:
            if first:
                state.sync_failed = False
            try:
                await engine.collective_rpc("update_param_batch", args=(payload, first, record))
            except Exception:
                state.sync_failed = True
                raise
            finally:
                sync_ok = not state.sync_failed
                if update.last:  # the sync is over, whatever happened
                    state.sync_failed = False
            if update.last and sync_ok:
                await engine.reset_prefix_cache()
                # with the version, no await between: an admission reads both or neither
                state.gate.lora_request = adapter  # after a full-weight sync: none
                state.version = update.version if update.version is not None else state.version + 1
                logger.info("weights updated: runtime version %d", state.version)

        by_id = getattr(update, "is_reference", False)  # broadcast requests only
        what = f"layout {update.layout}" if by_id else f"{len(update.names)} tensors"
        deadline = stage_deadline(self.cap, state.sync_bytes)
        start_background(state, f"update_param_batch({what})", work, deadline)
        return {"status": "ok", "error_count": state.error_count}

    async def load_weights_from_disk(self, request: Request) -> dict[str, Any]:
        """Load the safetensors files of a policy folder on this machine (body ``{"path":
        str, "version": int | null}``; 403 unless the folder lies under
        ``--weight-load-roots``), in the background like a sync: the workers report what
        they read and loaded (``/weight_report``), then the prefix cache is dropped and
        the version becomes ``version`` (or +1)."""
        engine, state, roots = self.engine, self.state, self.policy.load_roots
        body = await json_body(request)
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not path or len(path) > 4096:
            raise HTTPException(HTTPStatus.BAD_REQUEST, "path: a folder's path (a string)")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"version={str(version)[:32]!r}: an int")
        try:
            folder = check_load_path(path, roots)
            from ludic.distributed.weight_transfer.manifest import safetensors_files

            # each file resolved and checked too: one linked from outside the roots is refused
            files = [check_load_path(str(f), roots) for f in safetensors_files(folder)]
            nbytes = sum(f.stat().st_size for f in files)
        except LoadPathRefused as e:
            raise HTTPException(HTTPStatus.FORBIDDEN, str(e)) from None
        except (FileNotFoundError, OSError) as e:
            raise HTTPException(HTTPStatus.BAD_REQUEST, str(e)) from None

        checked = [str(f) for f in files]  # the workers read these, and only these

        async def work() -> None:
            await engine.collective_rpc("load_weights_from_disk", args=(checked, version))
            await engine.reset_prefix_cache()
            state.gate.lora_request = None  # full weights: no adapter serves requests
            state.version = version if version is not None else state.version + 1
            logger.info("weights loaded from %s: runtime version %d", folder, state.version)

        deadline = stage_deadline(self.cap, nbytes)
        start_background(state, f"load_weights_from_disk({folder.name})", work, deadline)
        return {"status": "ok", "error_count": state.error_count}

    async def lora_adapter(self, request: Request) -> dict[str, Any]:
        """Announce that the next sync carries a LoRA adapter, not full weights (body
        ``{"name": str, "config": peft's r, lora_alpha, target_modules}``); once it is
        loaded, every request that names no adapter is served with it
        (``ludic.inference.vllm.adapter``)."""
        from ludic.inference.vllm.adapter import ADAPTER_ID, check_adapter_config

        engine, state = self.engine, self.state
        body = await json_body(request)
        lora = getattr(engine.vllm_config, "lora_config", None)
        if lora is None:
            raise HTTPException(
                HTTPStatus.CONFLICT,
                "this server was started without LoRA support: start it with --lora-rank R "
                "to take adapter-only syncs",
            )
        name = body.get("name")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"bad adapter name {str(name)[:64]!r}")
        try:
            config = check_adapter_config(body.get("config") or {}, lora.max_lora_rank)
        except ValueError as e:
            raise HTTPException(HTTPStatus.BAD_REQUEST, str(e)) from None
        if state.adapter_folder is None:
            state.adapter_folder = tempfile.mkdtemp(prefix="ludic-lora-")
            atexit.register(shutil.rmtree, state.adapter_folder, ignore_errors=True)
        folder = state.adapter_folder
        adapter = {"name": name, "config": config, "folder": folder}
        set_adapter = engine.collective_rpc("set_lora_adapter", args=(adapter,))
        await bounded(state, "lora_adapter", set_adapter, self.cap)
        from vllm.lora.request import LoRARequest

        path = f"{folder}/rank0"  # the requests' copy (loaded in place by every worker)
        state.adapter_next = LoRARequest(lora_name=name, lora_int_id=ADAPTER_ID, lora_path=path)
        return {"status": "ok"}

    async def close_communicator(self) -> dict[str, str]:
        state = self.state
        if state.join_task is not None and not state.join_task.done():
            state.join_task.cancel()  # a join still waiting for its trainer: abandon it
        try:
            await asyncio.wait_for(state.lock.acquire(), LOCK_TIMEOUT_S)
        except TimeoutError:
            raise HTTPException(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the control plane is busy ({state.holder()}); retry /close_communicator "
                f"later (operations end within --weight-sync-timeout-cap={self.cap:.0f}s)",
            ) from None
        try:  # after every pending transfer
            state.communicator = False
            close = self.engine.collective_rpc("close_communicator")
            await bounded(state, "close_communicator", close, self.cap)
        finally:
            state.lock.release()
        return {"status": "ok"}

    async def reset_prefix_cache(self) -> dict[str, bool]:
        return {"success": bool(await self.engine.reset_prefix_cache())}

    async def pause(self, mode: str = Query("abort")) -> JSONResponse:
        if mode not in PAUSE_MODES:
            raise HTTPException(
                HTTPStatus.BAD_REQUEST, f"mode={mode[:64]!r}; expected one of {PAUSE_MODES}"
            )
        pausing = self.engine.pause_generation(mode=mode)
        await behind_closed_gate(self.state, "paused", pausing, self.cap)
        return JSONResponse({"status": "paused", "mode": mode})

    async def resume(self) -> dict[str, str]:
        async with self.state.pause_lock:
            try:
                await self.engine.resume_generation()
            finally:  # held requests go on (and see the version now current)
                self.state.gate.reopen()
        return {"status": "resumed"}

    async def is_paused(self) -> dict[str, bool]:
        return {"is_paused": not self.state.gate.is_open or bool(await self.engine.is_paused())}

    async def sleep(self, level: int = Query(1)) -> JSONResponse:
        """Free the GPU for a colocated trainer: level 1 offloads the weights to CPU memory
        and drops the KV cache; level 2 drops both (a weight sync must follow the wake-up).
        In-flight requests are aborted; the admission gate stays closed until /wake_up."""
        if level not in (1, 2):
            raise HTTPException(HTTPStatus.BAD_REQUEST, f"level={level}; expected 1 or 2")
        engine, state = self.engine, self.state
        require_sleep_mode(engine)

        async def after_updates() -> None:  # never in the middle of a weight update
            async with state.lock:
                await bounded(state, f"sleep(level={level})", engine.sleep(level), self.cap)

        await behind_closed_gate(state, "asleep", after_updates(), self.cap)
        return JSONResponse({"status": "asleep", "level": level})

    async def wake_up(self, tags: list[str] | None = TAGS_QUERY) -> JSONResponse:
        """Take the GPU back: ``tags`` ``weights`` (first, so that a weight sync can write
        them before the KV cache is allocated), ``kv_cache``, or both (default). Serving
        resumes once everything is awake."""
        for tag in tags or ():
            if tag not in WAKE_TAGS:
                raise HTTPException(
                    HTTPStatus.BAD_REQUEST, f"tag {tag[:64]!r}; expected some of {WAKE_TAGS}"
                )
        engine, state = self.engine, self.state
        require_sleep_mode(engine)
        async with state.pause_lock:
            await bounded(state, "wake_up", engine.wake_up(tags), self.cap)
            sleeping = bool(await engine.is_sleeping())
            if not sleeping:
                state.gate.reopen()
        return JSONResponse({"status": "asleep" if sleeping else "awake", "tags": tags})

    async def is_sleeping(self) -> dict[str, bool]:
        return {"is_sleeping": bool(await self.engine.is_sleeping())}

    async def admission(self) -> dict[str, Any]:
        return self.state.gate.status()


async def join_group(engine: Any, info: TorchDistributedWeightSyncInfo) -> None:
    """Have the workers join the group of ``info`` (in a thread of their own; the engine
    keeps generating) and wait until they all have, within its timeout."""
    await engine.collective_rpc("init_communicator", args=(info.to_dict(), info.rank_offset))
    deadline = time.monotonic() + info.timeout_s + GRACE_S
    poll_s, max_poll_s = JOIN_POLL_S
    while True:
        states = await engine.collective_rpc("communicator_status")
        failed = [s["error"] for s in states if s["state"] == "failed"]
        if failed:
            raise RuntimeError(f"a worker could not join the group: {failed[0]}")
        if any(s["state"] == "none" for s in states):
            raise RuntimeError("the join was abandoned (/close_communicator)")
        if all(s["state"] == "joined" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the workers did not join {info.master_addr}:{info.master_port} "
                f"within {info.timeout_s:.0f}s"
            )
        await asyncio.sleep(poll_s)
        poll_s = min(2 * poll_s, max_poll_s)


async def behind_closed_gate(
    state: ControlState, what: str, work: Awaitable[Any], cap_s: float
) -> None:
    """Close the admission gate (nothing new is admitted; every admitted request reaches
    the engine, within ``cap_s``), then await ``work`` (pause, sleep); the gate reopens if
    either fails. ``what`` ("paused", "asleep") names the state in a 503."""
    async with state.pause_lock:
        try:
            await state.gate.close(cap_s)
        except TimeoutError as e:
            if inspect.iscoroutine(work):
                work.close()  # never started
            raise HTTPException(
                HTTPStatus.SERVICE_UNAVAILABLE, f"not {what}: {e}; the server keeps serving"
            ) from None
        try:
            await work
        except BaseException:
            state.gate.reopen()
            raise


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


def device_type(engine: Any) -> str:
    """``cuda``, ``cpu``, ...: where the engine's workers run."""
    return str(engine.vllm_config.device_config.device_type)


def require_sleep_mode(engine: Any) -> None:
    """409 unless the server was started with ``--enable-sleep-mode`` (CUDA only)."""
    if not getattr(engine.vllm_config.model_config, "enable_sleep_mode", False):
        raise HTTPException(
            HTTPStatus.CONFLICT,
            "this server was started without --enable-sleep-mode (vLLM supports it on CUDA "
            f"only; this server runs on {device_type(engine)}); nothing was changed",
        )
