"""Partial rollouts: what a vLLM client does with a completion aborted by a weight update.

A publish with a pause aborts every request in flight (finish reason ``"abort"``, the tokens
so far returned). ``partial_rollouts``: ``"off"`` returns it as it is; ``"continue"`` sends
prompt + tokens so far with the same sampling and the budget reduced, until a real finish, and
stitches the pieces (ids and logprobs end to end, one version per token in
``TokenTrace.completion_versions``, a seed derived from the seed and the tokens so far);
``"restart"`` discards them and sends the request again. What a continuation cannot
reproduce, and straddled versions: docs/real-model.md, "Policy versions and partial rollouts".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec
from ludic.types import ChatResponse, TokenTrace, logprob_temperature

PartialRollouts = Literal["off", "continue", "restart"]
PARTIAL_ROLLOUTS: tuple[str, ...] = get_args(PartialRollouts)
DEFAULT_MAX_CONTINUATIONS = 16
"""Aborts one request may go through before :class:`PartialRolloutError`."""


class PartialRolloutError(RuntimeError):
    """A request was aborted more often than ``max_continuations`` allows."""


def check_partial_rollouts(mode: str, owner: str = "partial_rollouts") -> None:
    """Raise ``ValueError`` naming ``owner`` unless ``mode`` is one of
    :data:`PARTIAL_ROLLOUTS`."""
    if mode not in PARTIAL_ROLLOUTS:
        raise ValueError(f"{owner}={mode!r}; expected one of {PARTIAL_ROLLOUTS}")


@dataclass(frozen=True)
class Segment:
    """One HTTP completion: the whole answer, or one piece of a continued one.

    ``aborted``: vLLM ended it with finish reason ``"abort"`` (e.g. a pause for a weight
    update); ``version`` / ``version_end``: the server's version headers.
    """

    id: str | None
    text: str
    token_ids: tuple[int, ...] | None
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    aborted: bool
    version: int | None
    version_end: int | None

    @property
    def num_tokens(self) -> int:
        return 0 if self.token_ids is None else len(self.token_ids)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "num_tokens": self.num_tokens,
            "finish_reason": self.finish_reason,
            "version": self.version,
            "version_end": self.version_end,
        }


def next_request(
    request: CompletionRequest, mode: PartialRollouts, generated: tuple[int, ...]
) -> CompletionRequest:
    """The request to send after ``generated`` (the tokens kept so far; empty at first or
    after a restart). Token ids are always asked for when a mode is on (a continuation
    needs them); the final response honours ``request.returns``."""
    spec = request.inference
    if mode == "off":
        return request
    returns = ReturnSpec(return_token_ids=True, return_logprobs=request.returns.return_logprobs)
    spec = replace(spec, returns=returns)
    if mode == "continue" and generated:
        spec = _continued(spec, len(generated))
    return replace(
        request, prompt_token_ids=(*request.prompt_token_ids, *generated), inference=spec
    )


def _continued(spec: InferenceSpec, done: int) -> InferenceSpec:
    sampling = replace(
        spec.sampling,
        max_tokens=spec.sampling.max_tokens - done,
        seed=None if spec.sampling.seed is None else continuation_seed(spec.sampling.seed, done),
    )
    extra = dict(spec.extra)
    if isinstance(extra.get("min_tokens"), int):
        extra["min_tokens"] = max(0, extra["min_tokens"] - done)
    return replace(spec, sampling=sampling, extra=extra)


def continuation_seed(seed: int, done: int) -> int:
    """The seed of a continuation after ``done`` tokens: a 63-bit hash of both (so that
    it replays neither the original stream nor another request's seed + offset)."""
    digest = hashlib.blake2b(f"{seed}:{done}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def stitch(
    request: CompletionRequest, kept: list[Segment], attempts: list[Segment] | None = None
) -> ChatResponse:
    """One ``ChatResponse`` from the pieces ``kept`` (in order; all but the last aborted).
    ``attempts``: every completion sent for it, in order (``kept`` plus those a restart
    discarded), summarised in ``meta["segments"]`` when there was more than one."""
    attempts = kept if attempts is None else attempts
    last = kept[-1]
    version: int | None = None
    per_token: tuple[int, ...] | None = None
    if all(s.version is not None for s in kept):
        per_token = tuple(int(s.version) for s in kept for _ in range(s.num_tokens))  # type: ignore[arg-type]
        version = per_token[0] if per_token else last.version
        if len(kept) == 1:
            per_token = None  # one version for every token: policy_version says it
    ends = [
        int(s.version_end)
        for s in kept
        if s.version is not None and s.version_end is not None and s.version_end > s.version
    ]
    newest_known = per_token[-1] if per_token else version
    straddled = ends and newest_known is not None and max(ends) > newest_known
    version_end = max(ends) if straddled else None  # a sync landed without a pause
    meta: dict[str, Any] = {
        "id": last.id,
        "policy_version": version,
        "policy_version_end": last.version_end,
    }
    if len(attempts) > 1:
        meta["segments"] = [s.summary() for s in attempts]
        kept_ids = {id(s) for s in kept}
        meta["discarded_tokens"] = sum(s.num_tokens for s in attempts if id(s) not in kept_ids)
    trace = None
    if request.returns.return_token_ids:
        logprobs = None
        if request.returns.return_logprobs:
            logprobs = tuple(lp for s in kept for lp in (s.logprobs or ()))
        trace = TokenTrace(
            prompt_token_ids=request.prompt_token_ids,
            completion_token_ids=tuple(t for s in kept for t in (s.token_ids or ())),
            completion_logprobs=logprobs,
            finish_reason=last.finish_reason,
            policy_version=version,
            completion_versions=per_token,
            version_end=version_end,
            logprob_temperature=logprob_temperature(request.sampling.temperature),
        )
    text = "".join(s.text for s in kept)
    return ChatResponse(text=text, finish_reason=last.finish_reason, trace=trace, meta=meta)
