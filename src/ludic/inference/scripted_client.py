"""A ``ChatClient`` that answers from a script: for tests and offline demos.

It behaves like a token-in backend in everything but choosing the text: it tokenizes the
scripted completion with a real tokenizer, honours ``max_tokens`` and ``stop``, appends the
EOS token on a natural stop, returns deterministic pseudo-logprobs, reports the last
synced ``policy_version`` and records every request it served.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ludic.inference.request import CompletionRequest, SamplingSpec
from ludic.types import ChatResponse, TokenTrace, logprob_temperature

Script = Sequence[str] | Callable[[CompletionRequest, str], str]
"""Either completion texts served in order, or ``(request, prompt_text) -> text``."""


class ScriptExhaustedError(RuntimeError):
    """A list-scripted client was asked for more completions than its script holds."""


class ScriptedChatClient:
    """Serves scripted completions through the ``ChatClient`` contract.

    Per request the completion text is cut at the first ``stop`` string (finish
    ``"stop"``, no EOS, like vLLM), else tokenized and, if it fits, followed by the EOS
    token (finish ``"stop"``). A completion with more than ``max_tokens`` tokens (EOS
    included) is cut to ``max_tokens`` tokens with finish ``"length"``. The returned
    ``text`` never contains the EOS token.

    Logprobs, when requested, are negative pseudo-values drawn from an RNG seeded by
    ``seed``, the prompt ids and the completion ids: the same request and text give the
    same logprobs, one per completion token.

    Args:
        tokenizer: a Hugging Face tokenizer (encodes completions, decodes prompts).
        script: completion texts served in order, or a callable ``(request, prompt_text)
            -> text`` where ``prompt_text`` is the decoded prompt, control tokens included.
        append_eos: append ``tokenizer.eos_token_id`` on a natural stop, as a model that
            ends its turn does.
        seed: seeds the pseudo-logprobs.
        policy_version: reported until the first ``sync_weights``.

    Attributes:
        requests: every ``CompletionRequest`` served, in order.
        prompts: the decoded prompt text of each request.
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Script,
        *,
        append_eos: bool = True,
        seed: int = 0,
        policy_version: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        if callable(script):
            self._script_fn: Callable[[CompletionRequest, str], str] | None = script
            self._script: list[str] = []
        elif isinstance(script, str):
            raise TypeError(
                "ScriptedChatClient: script is a single string; pass a list of completions "
                f"(e.g. [{script[:20]!r}]) or a callable (request, prompt_text) -> str"
            )
        else:
            self._script_fn = None
            self._script = list(script)
        self.eos_token_id: int | None = tokenizer.eos_token_id if append_eos else None
        if append_eos and self.eos_token_id is None:
            raise ValueError(
                f"ScriptedChatClient: tokenizer {type(tokenizer).__name__} has no eos_token_id; "
                "set one on the tokenizer or pass append_eos=False"
            )
        self.seed = seed
        self.policy_version = policy_version
        self.requests: list[CompletionRequest] = []
        self.prompts: list[str] = []

    @property
    def remaining(self) -> int | None:
        """Completions left in a list script (``None`` for a callable script)."""
        if self._script_fn is not None:
            return None
        return len(self._script) - len(self.requests)

    async def complete(self, request: CompletionRequest) -> ChatResponse:
        prompt_text = self.tokenizer.decode(
            list(request.prompt_token_ids), skip_special_tokens=False
        )
        text = self._next_text(request, prompt_text)
        self.requests.append(request)
        self.prompts.append(prompt_text)

        text, ids, finish_reason = self._generate(text, request.sampling)
        trace = None
        if request.returns.return_token_ids:
            logprobs = (
                self._pseudo_logprobs(request.prompt_token_ids, ids)
                if request.returns.return_logprobs
                else None
            )
            trace = TokenTrace(
                prompt_token_ids=request.prompt_token_ids,
                completion_token_ids=tuple(ids),
                completion_logprobs=logprobs,
                finish_reason=finish_reason,
                policy_version=self.policy_version,
                logprob_temperature=logprob_temperature(request.sampling.temperature),
            )
        return ChatResponse(
            text=text,
            finish_reason=finish_reason,
            trace=trace,
            meta={"call_index": len(self.requests) - 1},
        )

    def sync_weights(self, params: Mapping[str, torch.Tensor], *, version: int) -> str:
        """Record ``version`` (reported on later traces); the weights are not used."""
        self.policy_version = version
        return f"scripted: version {version} ({len(params)} tensors ignored)"

    # ---- helpers ----------------------------------------------------------------------
    def _next_text(self, request: CompletionRequest, prompt_text: str) -> str:
        if self._script_fn is not None:
            text = self._script_fn(request, prompt_text)
            if not isinstance(text, str):
                raise TypeError(
                    f"ScriptedChatClient: the script callable returned {type(text).__name__}, "
                    "expected the completion text (str)"
                )
            return text
        served = len(self.requests)
        if served >= len(self._script):
            raise ScriptExhaustedError(
                f"ScriptedChatClient: request #{served + 1} but the script holds only "
                f"{len(self._script)} completions; add completions to the script or pass a "
                "callable script"
            )
        return self._script[served]

    def _generate(self, text: str, sampling: SamplingSpec) -> tuple[str, list[int], str]:
        """``(text, completion ids, finish_reason)`` under ``max_tokens`` and ``stop``."""
        stop_at = min((i for s in sampling.stop if (i := text.find(s)) >= 0), default=-1)
        if stop_at >= 0:
            text = text[:stop_at]
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        natural_end = [] if stop_at >= 0 or self.eos_token_id is None else [self.eos_token_id]
        if len(ids) + len(natural_end) <= sampling.max_tokens:
            return text, ids + natural_end, "stop"
        ids = ids[: sampling.max_tokens]
        return self.tokenizer.decode(ids, skip_special_tokens=True), ids, "length"

    def _pseudo_logprobs(self, prompt_ids: Sequence[int], ids: Sequence[int]) -> tuple[float, ...]:
        digest = hashlib.sha256(
            struct.pack(
                f"<{len(prompt_ids) + len(ids) + 2}q", self.seed, len(prompt_ids), *prompt_ids, *ids
            )
        ).digest()
        rng = random.Random(digest)
        return tuple(-0.01 - rng.expovariate(1.0) for _ in ids)
