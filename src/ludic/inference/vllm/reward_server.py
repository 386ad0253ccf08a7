"""ludic's reward server: vLLM's OpenAI-compatible app for a one-label sequence-classification
reward model (``--runner pooling``), ludic's ``POST /score`` and the policy server's control
plane (weight sync, runtime version, API key).

    ludic serve reward --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [vLLM args]

Other models, and ``--runner generate``, are refused at start-up. ``/score`` replaces vLLM's
cross-encoder route: vLLM's classify pooling task (as ``/classify``), all inputs submitted at
once. Its schema and errors: docs/reward-models.md; the control routes are ``control``'s.
"""

from __future__ import annotations

import uuid
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from ludic._async import gather_or_cancel
from ludic.inference.reward_client import POOLING_TYPES
from ludic.inference.vllm.server import (
    ServerContext,
    json_body,
    parse_args,
    serve,
)

SERVER_TYPE = "reward_model"
SCORE_FIELDS = ("input", "model", "normalize", "pooling_type", "return_hidden_states")


# ------------------------------------------------------------------------------ body
class ScoreBodyError(ValueError):
    """A ``/score`` body the server refuses; the message names the field."""


@dataclass(frozen=True)
class ScoreBody:
    """A validated ``/score`` request."""

    inputs: tuple[str | tuple[int, ...], ...]
    model: str  # a served model name
    normalize: bool


def parse_score_body(
    body: Mapping[str, Any],
    *,
    served_models: Sequence[str],
    pooling_type: str,
    vocab_size: int,
) -> ScoreBody:
    """Check a ``/score`` JSON body against the server (its model names, pooling type and
    vocabulary); raises :class:`ScoreBodyError` naming the first bad field."""
    unknown = sorted(set(body) - set(SCORE_FIELDS))
    if unknown:
        raise ScoreBodyError(f"unknown field(s) {unknown}; /score accepts {list(SCORE_FIELDS)}")
    model = body.get("model")
    if model is None:
        model = served_models[0]
    elif model not in served_models:
        raise ScoreBodyError(f"model={model!r} is not served here; served: {list(served_models)}")
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ScoreBodyError(f"normalize must be true or false, got {normalize!r}")
    requested_pooling = body.get("pooling_type")
    if requested_pooling is not None and requested_pooling != pooling_type:
        raise ScoreBodyError(
            f"pooling_type={requested_pooling!r}, but this server pools {pooling_type!r} "
            f"(fixed at start-up; one of {POOLING_TYPES}); send {pooling_type!r} or omit it"
        )
    hidden = body.get("return_hidden_states", False)
    if hidden is not False:
        raise ScoreBodyError(
            f"return_hidden_states={hidden!r} is not supported: this server returns scores "
            "only; omit it or send false"
        )
    return ScoreBody(_parse_inputs(body.get("input"), vocab_size), model, normalize)


def _parse_inputs(inputs: Any, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    if inputs is None:
        raise ScoreBodyError("input is missing: send a list of texts or token-id lists")
    if isinstance(inputs, str):
        raise ScoreBodyError('input must be a list, got one string; wrap it: ["..."]')
    if not isinstance(inputs, list) or not inputs:
        raise ScoreBodyError(
            f"input must be a non-empty list of texts or token-id lists, got {inputs!r:.80}"
        )
    parsed: list[str | tuple[int, ...]] = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise ScoreBodyError(f"input[{i}] is an empty string: nothing to score")
            parsed.append(item)
            continue
        if not isinstance(item, list) or not item:
            raise ScoreBodyError(
                f"input[{i}] must be a string or a non-empty list of token ids, got {item!r:.80}"
            )
        for j, token in enumerate(item):
            if isinstance(token, bool) or not isinstance(token, int):
                raise ScoreBodyError(f"input[{i}][{j}] must be a token id (int), got {token!r}")
            if not 0 <= token < vocab_size:
                raise ScoreBodyError(
                    f"input[{i}][{j}]={token} is not a token id of this model "
                    f"(vocabulary size {vocab_size})"
                )
        parsed.append(tuple(item))
    return tuple(parsed)


# ------------------------------------------------------------------------------ route
def make_score_router(context: ServerContext) -> APIRouter:
    """``POST /score`` on the context's engine. Refuses (``RuntimeError``) a model that is
    not a one-label sequence classifier, so a wrong model fails at start-up."""
    engine = context.engine
    model_config = engine.model_config
    check_reward_model(model_config, context.supported_tasks)
    served_models = list(context.args.served_model_name or [context.args.model])
    pooling_type = str(model_config.pooler_config.seq_pooling_type).lower()
    vocab_size = int(model_config.get_vocab_size())
    router = APIRouter()  # the app's ApiKeyMiddleware guards it

    @router.post("/score")
    async def score(request: Request) -> dict[str, Any]:
        try:
            body = parse_score_body(
                await json_body(request),
                served_models=served_models,
                pooling_type=pooling_type,
                vocab_size=vocab_size,
            )
        except ScoreBodyError as e:
            raise HTTPException(HTTPStatus.BAD_REQUEST, str(e)) from None
        outputs = await classify_all(engine, body.inputs, use_activation=body.normalize)
        return {
            "model": body.model,
            "data": [{"index": i, "score": first_score(out)} for i, out in enumerate(outputs)],
            "usage": {"prompt_tokens": sum(len(out.prompt_token_ids) for out in outputs)},
        }

    return router


def check_reward_model(model_config: Any, supported_tasks: Sequence[str]) -> None:
    """Raise ``RuntimeError`` unless the served model classifies with one label."""
    if "classify" not in supported_tasks:
        raise RuntimeError(
            f"{model_config.model} supports {list(supported_tasks)}, not 'classify': the "
            "reward server needs a sequence-classification model (e.g. "
            "Qwen2ForSequenceClassification with num_labels=1)"
        )
    num_labels = getattr(model_config.hf_config, "num_labels", None)
    if num_labels != 1:
        raise RuntimeError(
            f"{model_config.model} has num_labels={num_labels}; a reward model has one "
            "label (one score per sequence)"
        )


async def classify_all(
    engine: Any, inputs: Sequence[str | Sequence[int]], *, use_activation: bool
) -> list[Any]:
    """Classify every input (vLLM's ``/classify`` pipeline): render (tokenize) all inputs,
    then submit them as one engine request each, all at once, so the scheduler batches
    them. Returns the ``PoolingRequestOutput``s in input order.

    A bad input (e.g. longer than ``max_model_len``) is a 400 naming it; any failure
    cancels the other requests (their engine requests are aborted)."""
    from vllm import PoolingParams

    renderer = engine.renderer
    tok_params = renderer.default_cmpl_tok_params  # max_model_len check, special tokens
    engine_inputs = await gather_or_cancel(
        *(_render(renderer, tok_params, i, x) for i, x in enumerate(inputs))
    )
    params = PoolingParams(task="classify", use_activation=use_activation)  # vLLM clones it
    request_id = f"score-{uuid.uuid4().hex}"
    return await gather_or_cancel(
        *(_encode(engine, i, x, params, f"{request_id}-{i}") for i, x in enumerate(engine_inputs))
    )


async def _render(renderer: Any, tok_params: Any, index: int, item: str | Sequence[int]) -> Any:
    from vllm.exceptions import VLLMClientError

    prompt = {"prompt": item} if isinstance(item, str) else {"prompt_token_ids": list(item)}
    try:
        (engine_input,) = await renderer.render_cmpl_async([prompt], tok_params)
    except (ValueError, VLLMClientError) as e:
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"input[{index}]: {e}") from None
    return engine_input


async def _encode(engine: Any, index: int, engine_input: Any, params: Any, request_id: str) -> Any:
    from vllm.exceptions import GenerationError, VLLMClientError

    final = None
    try:
        async for output in engine.encode(engine_input, params, request_id):
            final = output
    except (ValueError, VLLMClientError) as e:
        raise HTTPException(HTTPStatus.BAD_REQUEST, f"input[{index}]: {e}") from None
    if final is None:
        raise GenerationError(f"input[{index}]: the engine returned no output")
    if final.error is not None:
        raise GenerationError(f"input[{index}]: {final.error.message}")
    return final


def first_score(output: Any) -> float:
    """The one-label score of a classify ``PoolingRequestOutput``."""
    data = output.outputs.data
    if data.numel() != 1:
        raise RuntimeError(f"expected one score per input, got {data.numel()} values")
    return float(data.reshape(-1)[0])


# ------------------------------------------------------------------------------ main
def force_pooling_runner(args: Namespace) -> Namespace:
    """Serve with ``--runner pooling``; refuse another runner the user asked for."""
    if args.runner not in ("auto", "pooling"):
        raise SystemExit(
            f"ludic's reward server runs vLLM with --runner pooling, but --runner "
            f"{args.runner} was given: drop it (or serve a policy with `ludic serve policy`)"
        )
    args.runner = "pooling"
    return args


def main(argv: list[str] | None = None) -> None:
    """``python -m ludic.inference.vllm.reward_server``: the reward server."""
    args = force_pooling_runner(parse_args(argv, __doc__.split("\n")[0]))
    serve(args, server_type=SERVER_TYPE, extra_routers=[make_score_router])


if __name__ == "__main__":
    main()
