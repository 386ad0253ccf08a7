"""An OpenAI-compatible endpoint of ludic's own for agent programs, recording exact tokens.

An OpenAI-API agent runs unchanged on the ``openai.AsyncOpenAI`` client ludic hands it (its
base URL an episode of this endpoint). Each call (chat completions with tools, completions)
is rendered with the policy's chat template, sampled by ludic's ``ChatClient`` and recorded
(prompt ids, completion ids and logprobs, policy version) so training uses those exact tokens
(:class:`~ludic.interaction.program.ProgramProtocol`); tool calls: ``tool_parser``. A request
never changes the run's sampler; routes, sampling rules, security: docs/envs/programs.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jinja2 import TemplateError

from ludic.inference.asgi import read_body, send_error, send_json, serve_in_thread
from ludic.inference.chat_template import HFChatTemplate
from ludic.inference.client import ChatClient
from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec
from ludic.inference.tool_parser import ToolCallParser, XMLJsonToolCallParser
from ludic.inference.vllm.security import ApiKeyMiddleware, is_loopback
from ludic.types import Message, TokenTrace, ToolCall

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20
"""Larger request bodies are refused with 413."""

MODEL_NAME = "ludic-policy"
"""The model the endpoint serves (any ``model`` in a request is accepted)."""


@dataclass(frozen=True)
class RecordedCall:
    """One model call of an episode, as sampled.

    ``messages`` and ``tools`` are the prompt as rendered (chat; for completions the
    prompt text as one user message), ``text`` the completion returned to the program,
    ``trace`` its exact tokens (prompt ids, completion ids and logprobs, policy version).
    ``requested`` holds the sampling fields the request carried.
    """

    index: int
    route: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    text: str
    trace: TokenTrace
    tool_calls: tuple[ToolCall, ...] = ()
    requested: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Episode:
    id: str
    loop: asyncio.AbstractEventLoop
    inference: InferenceSpec
    max_calls: int | None
    calls: list[RecordedCall] = field(default_factory=list)
    raw: dict[str, str] = field(default_factory=dict)
    """Tool-call id -> the exact completion text of the call that made it."""
    started: int = 0
    refused: int = 0
    """Calls refused because ``max_calls`` were made."""
    in_flight: int = 0
    futures: set[Any] = field(default_factory=set)
    """The calls running in the episode's loop (cancelled when it closes)."""


class AgentEndpoint:
    """The endpoint (see the module docstring) over ``client`` and ``template``.

    Start it with :meth:`start` (a server thread; :meth:`close` stops it), then per
    episode: :meth:`open_episode` in the event loop where ``client`` is used, the
    program's calls, :meth:`close_episode` for the recorded calls.
    """

    def __init__(
        self,
        client: ChatClient,
        template: HFChatTemplate,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        tool_parser: ToolCallParser | None = None,
        structured_outputs: bool = False,
    ) -> None:
        self.client = client
        self.template = template
        self.host = host
        self.port = port
        self.api_key = api_key or secrets.token_urlsafe(24)  # so never open beyond loopback
        if not is_loopback(host):
            logger.warning(
                "the agent endpoint listens on %s beyond loopback, over plain HTTP (its API "
                "key travels unencrypted): keep that network private",
                host,
            )
        self.tool_parser = tool_parser or XMLJsonToolCallParser()
        self.structured_outputs = structured_outputs
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("AgentEndpoint: not started; call start()")
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> AgentEndpoint:
        """Serve in a daemon thread; returns once the server accepts connections."""
        with self._lock:
            if self._server is not None:
                return self
            app = ApiKeyMiddleware(self, self.api_key)
            server, thread, self.port = serve_in_thread(
                app,
                host=self.host,
                port=self.port,
                name="ludic-agent-endpoint",
                timeout_s=timeout_s,
            )
            self._server, self._thread = server, thread
        return self

    def close(self) -> None:
        """Stop the server (episodes still open get connection errors)."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout=10.0)
        self._server = self._thread = None

    # ------------------------------------------------------------------ episodes
    def open_episode(self, inference: InferenceSpec, *, max_calls: int | None = None) -> str:
        """A new episode's base URL (``.../episodes/ID/v1``); call it in the event loop
        where ``client`` runs: the episode's calls are sampled there."""
        self.start()
        episode = _Episode(
            id=secrets.token_hex(8),
            loop=asyncio.get_running_loop(),
            inference=replace(inference, returns=ReturnSpec.for_rl()),
            max_calls=max_calls,
        )
        with self._lock:
            self._episodes[episode.id] = episode
        return f"{self.url}/episodes/{episode.id}/v1"

    def close_episode(self, base_url: str) -> tuple[list[RecordedCall], int]:
        """The episode's recorded calls in the order they finished, and how many calls
        were refused past its ``max_calls``; later calls get 404."""
        episode_id = base_url.rstrip("/").split("/")[-2]
        with self._lock:
            episode = self._episodes.pop(episode_id)
            running = list(episode.futures)
        for future in running:  # a call of a cancelled or timed-out episode: stop it
            future.cancel()
        return list(episode.calls), episode.refused

    def openai_client(self, base_url: str, *, timeout_s: float = 600.0) -> Any:
        """An ``openai.AsyncOpenAI`` client of the episode (no retries: a failed call is
        the program's to see)."""
        import openai

        return openai.AsyncOpenAI(
            base_url=base_url, api_key=self.api_key, max_retries=0, timeout=timeout_s
        )

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return None
        path, method = scope["path"], scope["method"]
        if path == "/health":
            return await send_json(send, 200, {"status": "ok", "type": "agent_endpoint"})
        parts = path.strip("/").split("/")
        if len(parts) < 4 or parts[0] != "episodes" or parts[2] != "v1":
            return await send_error(send, 404, f"no route {path}; use /episodes/ID/v1/...")
        with self._lock:
            episode = self._episodes.get(parts[1])
        if episode is None:
            return await send_error(send, 404, f"episode {parts[1]!r} is not open")
        route = "/".join(parts[3:])
        if route == "models" and method == "GET":
            return await send_json(send, 200, _models())
        if route not in ("chat/completions", "completions") or method != "POST":
            return await send_error(send, 404, f"no route {method} /v1/{route}")
        body = await read_body(receive, MAX_BODY_BYTES)
        if body is None:
            return await send_error(send, 413, f"request body over {MAX_BODY_BYTES} bytes")
        try:
            request = json.loads(body)
            _check_request(request, structured_outputs=self.structured_outputs)
        except (ValueError, TypeError) as e:
            return await send_error(send, 400, f"bad request: {e}")
        with self._lock:
            if episode.max_calls is not None and episode.started >= episode.max_calls:
                episode.refused += 1
                over = True
            else:
                episode.started += 1
                over = False
        if over:
            return await send_error(
                send, 429, f"the episode made its {episode.max_calls} calls (agent.max_steps)"
            )
        # everything that reads or writes the episode (and the tokenizer) runs in its loop
        future = asyncio.run_coroutine_threadsafe(self._call(episode, route, request), episode.loop)
        with self._lock:
            episode.futures.add(future)
        try:
            answer = await asyncio.wrap_future(future)
        except _BadRequest as e:
            return await send_error(send, 400, f"bad request: {e}")
        except asyncio.CancelledError:
            return await send_error(send, 404, f"episode {episode.id!r} ended during the call")
        except Exception as e:  # the backend failed: the program sees a 502
            return await send_error(
                send, 502, f"the policy backend failed: {type(e).__name__}: {e}"
            )
        finally:
            with self._lock:
                episode.futures.discard(future)
        return await send_json(send, 200, answer)

    # ------------------------------------------------------------------ requests
    def _chat_prompt(
        self, episode: _Episode, request: Mapping[str, Any]
    ) -> tuple[list[Message], list[dict[str, Any]] | None, list[int]]:
        messages = [self._message(episode, m) for m in request["messages"]]
        if not messages:
            raise ValueError("messages is empty")
        tools = request.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ValueError("tools must be a list of function tools")
        return messages, tools, self._continued(episode, messages, tools)

    def _continued(
        self, episode: _Episode, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The prompt of ``messages``: when they continue an earlier call of the episode
        (its messages, then its reply), that call's exact prompt and completion tokens
        followed by the new messages (``ChatTemplate.extend``), so the policy's own tokens
        are never re-tokenized; else the template's rendering."""
        for call in reversed(episode.calls):
            n = len(call.messages)
            if (
                call.route == "chat/completions"
                and call.tools == tools
                and len(messages) > n + 1
                and [_key(m) for m in messages[:n]] == [_key(m) for m in call.messages]
                and _key(messages[n]) == ("assistant", call.text, None)
            ):
                try:
                    return self.template.extend(
                        list(call.trace.prompt_token_ids),
                        list(call.trace.completion_token_ids),
                        messages[n + 1 :],
                        tools=tools,
                    )
                except ValueError:  # a template whose earlier turns change: render
                    break
        return self.template.render(messages, tools=tools)

    def _completion_prompt(
        self, request: Mapping[str, Any]
    ) -> tuple[list[Message], None, list[int]]:
        prompt = request["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(self.template.tokenizer.encode(prompt, add_special_tokens=False))
            text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids, text = list(prompt), self.template.decode(prompt)
        else:
            raise ValueError("prompt must be one string or one list of token ids")
        if not ids:
            raise ValueError("the prompt is empty")
        return [{"role": "user", "content": text}], None, ids

    def _message(self, episode: _Episode, message: Any) -> Message:
        """An OpenAI message as the chat template renders it: text content (parts
        joined), and an assistant message whose tool calls came from this episode as the
        exact text the policy wrote."""
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"a message must be an object with a role: {message!r}")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        role = "system" if message["role"] == "developer" else message["role"]
        out: Message = {"role": role, "content": content or ""}
        calls = message.get("tool_calls") or []
        if message["role"] == "assistant" and calls:
            raw = {episode.raw.get(c.get("id")) for c in calls if isinstance(c, dict)}
            if len(raw) == 1 and None not in raw:
                out["content"] = raw.pop()  # as sampled
            else:
                out["tool_calls"] = [_template_tool_call(c) for c in calls]
        if message["role"] == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if "name" in message:
            out["name"] = message["name"]
        return out

    async def _call(
        self, episode: _Episode, route: str, request: Mapping[str, Any]
    ) -> dict[str, Any]:
        """One call, in the episode's loop: the prompt, the sample, the record."""
        try:
            if route == "chat/completions":
                prompt = self._chat_prompt(episode, request)
            else:
                prompt = self._completion_prompt(request)
        except (ValueError, TypeError, KeyError, TemplateError) as e:
            raise _BadRequest(f"{type(e).__name__}: {e}") from None
        return await self._sample(episode, route, request, *prompt)

    async def _sample(
        self,
        episode: _Episode,
        route: str,
        request: Mapping[str, Any],
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        prompt_ids: list[int],
    ) -> dict[str, Any]:
        """Sample in the episode's loop, record, and build the OpenAI response."""
        spec = _call_inference(episode, request)
        episode.in_flight += 1
        try:
            response = await self.client.complete(
                CompletionRequest(prompt_ids, inference=spec, session_id=episode.id)
            )
        finally:
            episode.in_flight -= 1
        if response.trace is None:
            raise RuntimeError("the backend returned no token trace")
        text = self.template.tokenizer.decode(
            list(response.trace.completion_token_ids), skip_special_tokens=True
        )
        index = len(episode.calls)
        parsed = self.tool_parser(text) if route == "chat/completions" else None
        calls: tuple[ToolCall, ...] = ()
        if parsed is not None and parsed.ok and parsed.calls:
            calls = tuple(
                replace(c, id=f"call_{episode.id}_{index}_{i}") for i, c in enumerate(parsed.calls)
            )
            for c in calls:
                episode.raw[c.id] = text
        requested = {k: request[k] for k in REQUESTED_FIELDS if k in request}
        episode.calls.append(
            RecordedCall(index, route, messages, tools, text, response.trace, calls, requested)
        )
        if route == "completions":
            choice: dict[str, Any] = {"text": text}
            kind, prefix = "text_completion", "cmpl"
        else:
            content = parsed.content if parsed is not None and calls else text
            choice = {"message": _chat_message(content, calls)}
            kind, prefix = "chat.completion", "chatcmpl"
        finish = "tool_calls" if calls else response.finish_reason or "stop"
        return {
            "id": f"{prefix}-{episode.id}-{index}",
            "object": kind,
            "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": [{"index": 0, **choice, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(response.trace.completion_token_ids),
                "total_tokens": len(prompt_ids) + len(response.trace.completion_token_ids),
            },
        }


class _BadRequest(ValueError):
    """A request the endpoint cannot serve (HTTP 400)."""


UNSUPPORTED = ("response_format", "logit_bias", "presence_penalty", "frequency_penalty")
"""Request fields refused rather than ignored: the run's sampler would not honour them."""


def _check_request(request: Any, *, structured_outputs: bool) -> None:
    """Refuse (``ValueError``) what the endpoint would otherwise ignore."""
    if not isinstance(request, dict):
        raise ValueError("the body is not a JSON object")
    if request.get("stream"):
        raise ValueError("streaming is not supported: send stream=false (or omit it)")
    if request.get("n", 1) != 1:
        raise ValueError(f"n={request['n']}: one choice per call")
    for name in UNSUPPORTED:
        if request.get(name) not in (None, 0, {}):
            raise ValueError(f"{name} is not supported (the run's sampling section decides)")
    if request.get("tool_choice") not in (None, "auto"):
        raise ValueError(f"tool_choice={request['tool_choice']!r}: only auto is supported")
    if request.get("logprobs") or request.get("top_logprobs"):
        raise ValueError("logprobs are recorded for training, not returned: omit logprobs")
    if "structured_outputs" in request and not structured_outputs:
        raise ValueError(
            "structured_outputs needs a backend that constrains sampling (inference.backend: vllm)"
        )


REQUESTED_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "structured_outputs",
)
"""The sampling fields of a request that its ``RecordedCall.requested`` keeps."""


def _call_inference(episode: _Episode, request: Mapping[str, Any]) -> InferenceSpec:
    """The episode's inference for one call: ``max_tokens`` capped by the request's, its
    ``stop`` added, vLLM's ``structured_outputs`` passed on, the seed the call's own."""
    sampling = episode.inference.sampling
    asked = request.get("max_completion_tokens") or request.get("max_tokens")
    max_tokens = sampling.max_tokens if asked is None else min(int(asked), sampling.max_tokens)
    stop = request.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    extra = dict(episode.inference.extra)
    if "structured_outputs" in request:  # vLLM's own field (extra_body in the SDK)
        extra["structured_outputs"] = request["structured_outputs"]
    index = len(episode.calls) + episode.in_flight
    seed = None if sampling.seed is None else call_seed(sampling.seed, index)
    sampling = replace(
        sampling, max_tokens=max(max_tokens, 1), stop=sampling.stop + stop, seed=seed
    )
    return replace(episode.inference, sampling=sampling, extra=extra)


def _chat_message(content: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The OpenAI assistant message of a chat completion: its text, or with tool calls the
    text outside them (``content``) and the calls."""
    if not calls:
        return {"role": "assistant", "content": content}
    tool_calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}


def call_seed(seed: int, index: int) -> int:
    """The sampling seed of call ``index`` of an episode seeded ``seed``: a 63-bit hash of
    both, so that two calls never share their random stream."""
    digest = hashlib.blake2b(f"{seed}:call:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _key(message: Message) -> tuple[Any, Any, Any]:
    return message.get("role"), message.get("content"), message.get("tool_call_id")


def _template_tool_call(call: Any) -> dict[str, Any]:
    """An OpenAI tool call as chat templates take it (arguments as an object)."""
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return {"type": "function", "function": {"name": function.get("name"), "arguments": arguments}}


def _models() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "ludic"}]}


__all__: Sequence[str] = ["MAX_BODY_BYTES", "AgentEndpoint", "RecordedCall"]
