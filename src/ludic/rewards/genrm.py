"""Generative reward models (GenRM): an LLM judge called through chat completions, its
judgement parsed into a score.

* :func:`chat_complete`: ``POST /v1/chat/completions`` to a server or the reward router
  (the ``reward_router_address`` the loop passes), with the shared retry policy;
* :func:`parse_judgement`: ``"... Score: 7"`` -> 0.7 (last match / ``scale``); no match
  raises, so an unreadable judgement is a recorded failure, never a silent 0;
* :class:`GenRMJudge`: a ready reward function, prompt template -> judge -> parser (with a
  vLLM judge, ``structured_outputs={"regex": ...}`` forces the judgement's format).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ludic.inference.vllm.http import AsyncHTTP

DEFAULT_TEMPLATE = (
    "Rate the answer to the question from 0 to 10.\n"
    "Question: {question}\nReference answer: {ground_truth}\nAnswer: {solution}\n"
    "Reply with 'Score: N'."
)
SCORE_PATTERN = r"Score:\s*(\d+(?:\.\d+)?)"

_clients: dict[tuple[str, str | None, float], AsyncHTTP] = {}


async def chat_complete(
    address: str,
    request: Mapping[str, Any],
    *,
    api_key: str | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """The JSON of ``POST {address}/v1/chat/completions`` with ``request`` (``messages``
    plus sampling parameters). Without a ``model`` a vLLM server answers with the model
    it serves, and a router sends the request to a backend that serves chat; name the
    model for servers that need one, or to pick one judge among several."""
    key = (address.rstrip("/"), api_key, timeout_s)
    http = _clients.get(key)
    if http is None:
        http = _clients[key] = AsyncHTTP(key[0], api_key=api_key, timeout_s=timeout_s)
    return (await http.post("/v1/chat/completions", dict(request))).json()


def parse_judgement(text: str, *, pattern: str = SCORE_PATTERN, scale: float = 10.0) -> float:
    """The number the last match of ``pattern`` captures, divided by ``scale``."""
    matches = re.findall(pattern, text)
    if not matches:
        raise ValueError(f"no judgement matching {pattern!r} in {text[-200:]!r}")
    return float(matches[-1]) / scale


class GenRMJudge:
    """A reward function that asks an LLM judge for a score.

    ``template`` is formatted with ``question`` (``extra_info["question"]``), ``solution``,
    ``ground_truth`` and every ``extra_info`` key; the judge's reply goes through
    :func:`parse_judgement` (``pattern``, ``scale``). ``address``: the judge server or the
    reward router; when ``None`` the reward loop's ``reward_router_address`` is used.
    ``sampling``: chat-completion parameters (``temperature``, ``max_tokens``,
    ``structured_outputs``, ...). ``model``: the judge's model name (``None``: the one
    the server, or a router's chat backend, serves).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        template: str = DEFAULT_TEMPLATE,
        pattern: str = SCORE_PATTERN,
        scale: float = 10.0,
        sampling: Mapping[str, Any] | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        model: str | None = None,
    ) -> None:
        re.compile(pattern)  # a bad pattern fails here, not per sample
        if scale <= 0:
            raise ValueError(f"GenRMJudge: scale={scale!r}; expected > 0")
        self.address = address
        self.template = template
        self.pattern = pattern
        self.scale = scale
        self.sampling = dict(sampling or {"temperature": 0.0, "max_tokens": 16})
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = model
        self.__name__ = "GenRMJudge"

    async def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: Mapping[str, Any] | None = None,
        reward_router_address: str | None = None,
    ) -> dict[str, float]:
        address = self.address or reward_router_address
        if address is None:
            raise ValueError(
                "GenRMJudge: no judge address (pass address= or run it in a reward loop with a router)"
            )
        info = dict(extra_info or {})
        prompt = self.template.format(
            **{
                **info,
                "question": info.get("question", ""),
                "solution": solution_str,
                "ground_truth": ground_truth,
            }
        )
        request: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
        if self.model is not None:
            request["model"] = self.model
        reply = await chat_complete(
            address,
            {**request, **self.sampling},
            api_key=self.api_key,
            timeout_s=self.timeout_s,
        )
        text = reply["choices"][0]["message"]["content"] or ""
        return {"score": parse_judgement(text, pattern=self.pattern, scale=self.scale)}
