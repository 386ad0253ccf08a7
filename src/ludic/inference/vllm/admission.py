"""Exact policy versions per request: the admission gate and the version headers.

A completion is labelled with the runtime version at which the engine *admitted* it, not the
one at which its HTTP request arrived. :meth:`AdmissionGate.install` wraps one engine instance's
``add_request``: it waits while the gate is closed (``/pause`` to ``/resume``), reads the version
(and an adapter-only sync's adapter) and records it in the request's :class:`Admission` (a
context variable). :class:`VersionHeaderMiddleware` sends it as ``x-ludic-policy-version``, the
version at response time as ``x-ludic-policy-version-end``. Not here: the routes (``control``).
Rules for users: docs/design.md, "Policy versions from a vLLM server".
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ludic.inference.vllm.http import VERSION_END_HEADER, VERSION_HEADER

__all__ = [
    "Admission",
    "AdmissionGate",
    "VersionHeaderMiddleware",
    "current_admission",
]


@dataclass
class Admission:
    """The runtime versions at which one HTTP request's engine adds were admitted (one per
    ``add_request``: one for a plain completion, more for several prompts)."""

    versions: list[int] = field(default_factory=list)


_ADMISSION: contextvars.ContextVar[Admission | None] = contextvars.ContextVar(
    "ludic_admission", default=None
)


def current_admission() -> Admission | None:
    """The :class:`Admission` of the HTTP request being served, if any."""
    return _ADMISSION.get()


class AdmissionGate:
    """Holds engine adds while closed and counts the adds in progress.

    Open while serving. :meth:`close` closes it and waits until every add that passed it
    has reached the engine; :meth:`reopen` lets the held adds through (each reads the
    runtime version only then).
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()  # set while no add is in progress
        self._idle.set()
        self.adding = 0
        """Adds past the gate that vLLM has not yet handed to the engine core."""
        self.held = 0
        """Adds waiting at the closed gate."""
        self.admitted = 0
        """Adds handed to the engine since start (a counter)."""
        self.lora_request: Any = None
        """The policy's LoRA adapter (a vLLM ``LoRARequest``) once an adapter-only sync
        loaded it: given to every add that names no adapter, read with the version."""

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def status(self) -> dict[str, Any]:
        """``GET /admission``: ``open``, ``held`` (waiting at the gate), ``adding`` (past
        the gate, not yet in the engine) and ``admitted`` (in the engine since start)."""
        return {
            "open": self.is_open,
            "held": self.held,
            "adding": self.adding,
            "admitted": self.admitted,
        }

    async def close(self, timeout_s: float) -> None:
        """Close the gate and wait until no add is in progress. After ``timeout_s`` the
        gate is reopened and ``TimeoutError`` raised (an add stuck that long means the
        engine is stuck; a pause then would not cover it)."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            self.reopen()
            raise TimeoutError(
                f"{self.adding} engine add(s) still in progress after {timeout_s:.0f}s"
            ) from None

    def reopen(self) -> None:
        self._open.set()

    async def admit(self, version: Callable[[], int]) -> int:
        """Wait while the gate is closed, then count an add in progress (the caller must
        call :meth:`done`) and return the runtime version it is admitted at."""
        while not self._open.is_set():
            self.held += 1
            try:
                await self._open.wait()
            finally:
                self.held -= 1
        # no await from here on: a pause that closes the gate now sees this add counted
        self.adding += 1
        self._idle.clear()
        return version()

    def done(self) -> None:
        self.adding -= 1
        if self.adding == 0:
            self._idle.set()

    def install(self, engine: Any, version: Callable[[], int]) -> None:
        """Wrap ``engine.add_request`` (on this engine instance only) so that every add
        passes the gate and records its admission version in the request's
        :class:`Admission`. Idempotent."""
        original = engine.add_request
        if getattr(original, "_ludic_gated", False):
            return

        @functools.wraps(original)
        async def add_request(*args: Any, **kwargs: Any) -> Any:
            admitted = await self.admit(version)
            if self.lora_request is not None and kwargs.get("lora_request") is None:
                kwargs["lora_request"] = self.lora_request  # the weights of `admitted`
            try:
                queue = await original(*args, **kwargs)
            finally:
                self.done()
            self.admitted += 1
            admission = _ADMISSION.get()
            if admission is not None:
                admission.versions.append(admitted)
            return queue

        add_request._ludic_gated = True  # type: ignore[attr-defined]
        engine.add_request = add_request


class VersionHeaderMiddleware:
    """Adds ``x-ludic-policy-version`` (the oldest admission version of the request, or
    the version at response start when nothing was admitted before it) and
    ``x-ludic-policy-version-end`` (the version at response start) to every response."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state  # ControlState: .version

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        admission = Admission()
        token = _ADMISSION.set(admission)

        async def send_with_versions(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                end = self.state.version
                start = min(admission.versions) if admission.versions else end
                message["headers"] = [
                    *message.get("headers", []),
                    (VERSION_HEADER.encode(), str(start).encode()),
                    (VERSION_END_HEADER.encode(), str(end).encode()),
                ]
            await send(message)

        try:
            await self.app(scope, receive, send_with_versions)
        finally:
            _ADMISSION.reset(token)
