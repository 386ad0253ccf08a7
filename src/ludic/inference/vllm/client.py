"""A ``ChatClient`` for ludic's vLLM server (``ludic.inference.vllm.server``), on
:class:`VLLMConnection`, the base it shares with the reward client (``reward_client``).

Generation: token-in ``POST /v1/completions`` (``return_token_ids``, ``logprobs=0``); the reply
is a ``ChatResponse`` whose ``TokenTrace`` holds the exact ids, logprobs, finish reason and
policy version. Weight sync: :meth:`VLLMChatClient.init_weight_sync` joins the server's
workers as rank 0; :meth:`VLLMChatClient.sync_weights` pushes a state dict (with ``pause``:
pause, push, resume even when the push fails). Not here: aborted completions (``partial``),
timeouts and retries (``http``), several servers (``pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Self, TypedDict, Unpack

import httpx
import torch

from ludic.inference.request import CompletionRequest
from ludic.inference.sampling import to_openai_params
from ludic.inference.vllm.canary import Canary
from ludic.inference.vllm.http import (  # noqa: F401 (re-exported)
    KEEPALIVE_EXPIRY_S,
    VERSION_END_HEADER,
    VERSION_HEADER,
    AsyncHTTP,
    VLLMControlPlane,
    VLLMServerError,
)
from ludic.inference.vllm.partial import (
    DEFAULT_MAX_CONTINUATIONS,
    PartialRolloutError,
    PartialRollouts,
    Segment,
    check_partial_rollouts,
    next_request,
    stitch,
)
from ludic.inference.vllm.weight_sync import VerifySync, WeightSyncSession
from ludic.types import FINISH_REASONS, ChatResponse

FINISH_REASON_MAP: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "tool_calls": "tool_calls",
    "repetition": "abort",  # vLLM cut a degenerate repetition short: not a natural stop
}
"""vLLM finish reasons -> ludic's (``ludic.types.FINISH_REASONS``)."""


# ------------------------------------------------------------------------------ base
class ConnectionOptions(TypedDict, total=False):
    """Keyword arguments every ludic vLLM client takes (see :class:`VLLMConnection`)."""

    host: str
    api_key: str | None
    timeout_s: float
    max_retries: int
    verify_sync: VerifySync


class VLLMConnection:
    """The base of the policy and reward clients: what they keep open to one server (the
    async data routes ``http``, the synchronous control plane ``control`` and the
    weight-sync session ``weight_sync``, with one API key, retry policy and timeout) and
    what they do alike with it (form the group, set the canary, close).

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"`` (default: from ``host``/``port``).
        api_key: sent as ``Authorization: Bearer`` (the server's ``--api-key``).
        timeout_s: bound on every HTTP call, on the weight-sync group's collectives and
            on waiting for a sync to be applied.
        max_retries: connection failures (the request never reached the server) are
            retried this many times, with httpx's exponential backoff.
        max_connections: concurrent data requests kept open.
        verify_sync: which syncs are verified against the server's report of what it
            received and loaded: ``"every"`` (default), ``"first"``, ``"off"``
            (``ludic.distributed.weight_transfer.verify``).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_connections: int = 256,
        verify_sync: VerifySync = "every",
    ) -> None:
        self.base_url = url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        retry = {"api_key": api_key, "timeout_s": timeout_s, "max_retries": max_retries}
        self.http = AsyncHTTP(url, max_connections=max_connections, **retry)
        self.control = VLLMControlPlane(url, **retry)
        self.weight_sync = WeightSyncSession(
            self.control, timeout_s=timeout_s, verify_sync=verify_sync
        )

    def init_weight_sync(self, **group: Any) -> None:
        """Form the weight-sync group with the server's workers; ``group``: the keywords of
        :meth:`WeightSyncSession.init` (``backend`` gloo/nccl, default nccl when CUDA is
        available; ``master_addr``; ``master_port``, default a free port, so a policy
        server's group and a reward server's never collide; ``strategy``; ``extractor``)."""
        self.weight_sync.init(**group)

    @property
    def publisher(self) -> Any:
        """The ``BroadcastPolicyPublisher`` after ``init_weight_sync`` (its ``extractor``
        sets the chunking; wrap a reward client's with ``create_reward_publisher(client)``
        to get mode checks in a Trainer)."""
        return self.weight_sync.publisher

    @property
    def sender(self) -> Any:
        """The weight-transfer sender (rank 0 of the group) after ``init_weight_sync``."""
        return self.weight_sync.sender

    def set_canary(self, canary: Canary | None, *, every: int = 10) -> None:
        """Check the server's answer to ``canary``'s fixed tokens against the trainer's
        (a ``ModelCanary`` of the trainer's model: logprobs; a ``RewardCanary`` of the
        reward model being trained: its raw score) after the first verified sync and every
        ``every`` syncs (``ludic.inference.vllm.canary``)."""
        self.weight_sync.canary, self.weight_sync.canary_every = canary, every

    def run_canary(self) -> None:
        """The canary's check, if the last sync asked for it, as the ``canary`` stage."""
        with self.weight_sync.stage("canary"):
            self.weight_sync.run_canary()

    def close(self) -> None:
        """Leave the weight-sync group (telling the server, if it still answers) and close
        the HTTP clients."""
        self.weight_sync.close()
        self.control.close()
        self.http.close()

    async def aclose(self) -> None:
        await self.http.aclose()
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ client
class VLLMChatClient(VLLMConnection):
    """``ChatClient`` over a ludic vLLM server.

    Args:
        model: the served model name (default: the server's first ``/v1/models`` entry).
        max_connections: concurrent completion requests kept open.
        partial_rollouts: what :meth:`complete` does with a completion aborted by a
            weight update (``ludic.inference.vllm.partial``): ``"off"`` (return it as it
            is), ``"continue"`` (continue from the tokens generated so far) or
            ``"restart"`` (send it again). With a mode on, :meth:`sync_weights` pauses
            the server by default.
        max_continuations: aborts one completion may go through before
            ``PartialRolloutError``.
        base_url, host, port, api_key, timeout_s, max_retries, verify_sync: the
            connection's (:class:`VLLMConnection`).

    ``TokenTrace.policy_version`` is the version at which the server admitted the request
    (``x-ludic-policy-version``); a continued completion carries one version per token
    (``TokenTrace.completion_versions``). A request sent while the server is paused waits
    there until it resumes: ``timeout_s`` must cover a publish cycle.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        port: int = 8000,
        model: str | None = None,
        max_connections: int = 256,
        partial_rollouts: PartialRollouts = "off",
        max_continuations: int = DEFAULT_MAX_CONTINUATIONS,
        **connection: Unpack[ConnectionOptions],
    ) -> None:
        check_partial_rollouts(partial_rollouts, "VLLMChatClient.partial_rollouts")
        if max_continuations < 0:
            raise ValueError(f"VLLMChatClient.max_continuations={max_continuations}; need >= 0")
        self.partial_rollouts = partial_rollouts
        self.asleep = False  # put to sleep by sleep(); woken by sync_weights() or wake_up()
        self.max_continuations = max_continuations
        self.model = model
        self._model_lookup: tuple[asyncio.AbstractEventLoop, asyncio.Task[str]] | None = None
        super().__init__(base_url, port=port, max_connections=max_connections, **connection)

    # ---- ChatClient: generation ----------------------------------------------------
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        """One completion; an aborted one is continued or restarted according to
        ``partial_rollouts`` (at most ``max_continuations`` times)."""
        mode = self.partial_rollouts
        attempts: list[Segment] = []
        kept: list[Segment] = []
        generated: tuple[int, ...] = ()
        while True:
            sent = next_request(request, mode, generated)
            segment = await self._generate(sent)
            attempts.append(segment)
            kept = [*kept, segment] if mode == "continue" else [segment]
            if not segment.aborted or mode == "off":
                return stitch(request, kept, attempts)
            if len(attempts) > self.max_continuations:
                raise PartialRolloutError(
                    f"{self.base_url}: a completion was aborted {len(attempts)} times "
                    f"(partial_rollouts={mode!r}, max_continuations={self.max_continuations}): "
                    "the server was paused for weight updates more often than it could "
                    "finish; raise max_continuations or publish less often"
                )
            if mode == "continue":
                generated = (*generated, *(segment.token_ids or ()))
                if len(generated) >= request.sampling.max_tokens:  # the budget is spent
                    kept[-1] = attempts[-1] = replace(
                        segment, finish_reason="length", aborted=False
                    )
                    return stitch(request, kept, attempts)

    async def _generate(self, request: CompletionRequest) -> Segment:
        body: dict[str, Any] = {
            "model": self.model or await self._served_model(),
            "prompt": [int(t) for t in request.prompt_token_ids],
            **to_openai_params(request.inference),
        }
        response = await self.http.post("/v1/completions", body)
        return self._segment(request, response)

    def _segment(self, request: CompletionRequest, response: httpx.Response) -> Segment:
        data = response.json()
        choice = data["choices"][0]
        raw_finish = choice.get("finish_reason")
        token_ids = logprobs = None
        if request.returns.return_token_ids:
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise VLLMServerError(
                    f"{self.base_url}/v1/completions returned no token_ids; the server must "
                    "be vLLM >= 0.10 (return_token_ids) - start it with ludic.inference.vllm.server"
                )
            if request.returns.return_logprobs:
                logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
                if logprobs is None or any(lp is None for lp in logprobs):
                    raise VLLMServerError(
                        f"{self.base_url}/v1/completions returned no chosen-token logprobs "
                        f"(got {logprobs!r}) although logprobs=0 was requested"
                    )
        return Segment(
            id=data.get("id"),
            text=choice.get("text") or "",
            token_ids=None if token_ids is None else tuple(int(t) for t in token_ids),
            logprobs=None if logprobs is None else tuple(map(float, logprobs)),
            finish_reason=_finish_reason(raw_finish),
            aborted=raw_finish == "abort",  # not "repetition", which ludic also calls abort
            version=_header_int(response, VERSION_HEADER),
            version_end=_header_int(response, VERSION_END_HEADER),
        )

    async def _served_model(self) -> str:
        """The server's model name, asked once: requests that start together before the
        first answer share one ``GET /v1/models``."""
        loop = asyncio.get_running_loop()
        if self._model_lookup is None or self._model_lookup[0] is not loop:
            self._model_lookup = (loop, loop.create_task(self._ask_model()))
        task = self._model_lookup[1]
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and (task.cancelled() or task.exception() is not None):
                self._model_lookup = None  # a failed lookup is tried again next time

    async def _ask_model(self) -> str:
        response = await self.http.get("/v1/models")
        models = response.json().get("data") or []
        if not models:
            raise VLLMServerError(f"{self.base_url}/v1/models lists no model; pass model=")
        self.model = str(models[0]["id"])
        return self.model

    # ---- ChatClient: weights -----------------------------------------------------
    def sync_weights(
        self, params: Mapping[str, torch.Tensor], *, version: int, pause: bool | None = None
    ) -> str:
        """Push ``params`` (HF names -> tensors; a subset is fine) as policy ``version``;
        returns once every worker has loaded them, raises otherwise.

        ``pause`` (default: on when ``partial_rollouts`` is not ``"off"``): the publish
        cycle. ``POST /pause?mode=abort`` first (in-flight requests end with finish reason
        ``"abort"``; new ones wait at the server), then the push (the server resets its
        prefix cache once the last chunk is loaded), then ``POST /resume``, which is sent
        whatever happened before it. Without a pause, requests in flight may straddle the
        update (their ``x-ludic-policy-version-end`` shows it).
        """
        sync = self.weight_sync
        if self.asleep:  # colocated: wake the weights, write them, then the KV cache
            with sync.stage("wake", version):
                self.control.wake_up(["weights"])
            sync.publish(params, version=version)
            if torch.cuda.is_available():  # the trainer's cached blocks back to the GPU
                torch.cuda.empty_cache()
            with sync.stage("wake"):
                self.control.wake_up(["kv_cache"])
            self.asleep = False
            self.run_canary()
            return f"synced {len(params)} tensors to {self.base_url} as version {version} (woken)"
        with self._paused(pause, version) as paused:
            sync.publish(params, version=version)
        self.run_canary()
        done = f"synced {len(params)} tensors to {self.base_url} as version {version}"
        return done + (" (paused: in-flight requests aborted)" if paused else "")

    @contextlib.contextmanager
    def _paused(self, pause: bool | None, version: int) -> Iterator[bool]:
        """The publish cycle around a weight change (see :meth:`sync_weights`): with
        ``pause`` (default: on when ``partial_rollouts`` is not ``"off"``), ``/pause``
        first and ``/resume`` after, whatever happened in between. Yields ``pause``."""
        if pause is None:
            pause = self.partial_rollouts != "off"
        if not pause:
            yield False
            return
        sync = self.weight_sync
        try:
            with sync.stage("pause", version):
                self.control.pause("abort")
            yield True
        finally:  # a failed pause or push must not leave the server paused
            with sync.stage("resume"):
                self.control.resume()

    def load_weights_from_disk(
        self,
        path: str | Path,
        *,
        version: int,
        expected: Any = None,
        pause: bool | None = None,
    ) -> str:
        """Have the server load the policy folder at ``path`` (e.g. a checkpoint's
        ``step_N/policy``; a path on the server's machine, under its
        ``--weight-load-roots``) as policy ``version``, verified as a sync is: each
        worker's report of what it read and loaded is checked against ``expected``
        (``SentChecksums``; default: the folder's ``ludic_checksums.json``, read here, or
        its files' checksums where ludic did not write it). For a server restarted from
        its checkpoint, or one far from the trainer; no weight-sync group is needed.
        ``pause``: as :meth:`sync_weights`."""
        from ludic.distributed.weight_transfer.manifest import expected_checksums

        if expected is None:
            try:
                expected = expected_checksums(path)
            except FileNotFoundError as e:
                raise FileNotFoundError(
                    f"{e}; pass expected= (the folder's ludic_checksums.json, read where the "
                    "folder is) when this machine cannot read it"
                ) from None
        with self._paused(pause, version):
            self.weight_sync.load_from_disk(str(path), version=version, expected=expected)
        return f"loaded {path} on {self.base_url} as version {version} (verified)"

    def set_lora_adapter(self, config: Mapping[str, Any] | None) -> None:
        """Publish a LoRA policy as its adapter only: with ``config`` (peft's ``r``,
        ``lora_alpha``, ``target_modules``), a sync of LoRA tensors (peft's names) is
        loaded through vLLM's LoRA support and serves every request
        (``ludic.inference.vllm.adapter``; the server needs ``--lora-rank``)."""
        self.weight_sync.lora_adapter = dict(config) if config is not None else None

    def get_policy_version(self) -> int:
        """The server's runtime version (bumped by every completed sync)."""
        return self.control.runtime_version()

    # ---- a trainer sharing the server's GPU ------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the GPU for training (server started with ``--enable-sleep-mode``): level 1
        keeps the weights in CPU memory, level 2 drops them (a sync must follow). Requests
        wait at the server until it wakes. The next :meth:`sync_weights` wakes it (weights
        first, so the update lands before the KV cache takes its memory back)."""
        with self.weight_sync.stage("sleep"):
            self.control.sleep(level)
        self.asleep = True

    def wake_up(self) -> None:
        """Wake everything (weights and KV cache) without a sync."""
        self.control.wake_up()
        self.asleep = False

    def is_sleeping(self) -> bool:
        return self.control.is_sleeping()


def _header_int(response: httpx.Response, name: str) -> int | None:
    value = response.headers.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise VLLMServerError(
            f"{response.request.url}: header {name}={value[:64]!r} is not an integer"
        ) from None


def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    mapped = FINISH_REASON_MAP.get(reason)
    if mapped is None or mapped not in FINISH_REASONS:
        raise VLLMServerError(
            f"vLLM returned finish_reason={reason!r}; ludic knows {sorted(FINISH_REASON_MAP)} "
            "(add it to ludic.inference.vllm.client.FINISH_REASON_MAP)"
        )
    return mapped
