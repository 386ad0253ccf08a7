"""An in-process ``ChatClient`` on a transformers causal LM: the embedded counterpart of a
vLLM server.

Concurrent ``complete`` calls are gathered into one left-padded batch and sampled
together with a KV cache, in eval mode (no dropout; the model's mode is restored after). Returned logprobs are the model's own log-probabilities of the
chosen tokens (log-softmax of the raw logits, before temperature / top-k / top-p), the
same quantity vLLM returns by default and the trainer recomputes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ludic.inference.request import CompletionRequest, SamplingSpec
from ludic.types import ChatResponse, TokenTrace


@dataclass
class _Row:
    request: CompletionRequest
    generator: torch.Generator | None
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    text: str = ""


class TransformersChatClient:
    """Token-in completions from a local HF causal LM.

    Args:
        model: a causal LM (``AutoModelForCausalLM``); used under ``torch.no_grad``.
        tokenizer: decodes completions and supplies the EOS id.
        eos_token_ids: token ids that end a completion (default: the tokenizer's EOS).
        max_batch_size: most requests sampled together.
        policy_version: the version reported until the first ``sync_weights``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_size: int = 32,
        policy_version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        eos = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
        if any(e is None for e in eos):
            raise ValueError("TransformersChatClient: no EOS token id; pass eos_token_ids=[...]")
        self.eos_token_ids = frozenset(int(e) for e in eos)
        self.pad_token_id = (
            tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else min(self.eos_token_ids)
        )
        self.max_batch_size = max_batch_size
        self.policy_version = policy_version
        self._lock = threading.Lock()
        self._pending: list[tuple[CompletionRequest, asyncio.Future[ChatResponse]]] = []
        self._worker: asyncio.Task[None] | None = None

    # ---- ChatClient -------------------------------------------------------------------
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ChatResponse] = loop.create_future()
        self._pending.append((request, fut))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await fut

    def sync_weights(self, params: Mapping[str, torch.Tensor], *, version: int) -> str:
        """Copy ``params`` into the serving model in place; names and shapes must match."""
        # state_dict names include tied aliases (e.g. lm_head.weight = embed_tokens.weight).
        own = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(params) - set(own))
        if unknown:
            raise KeyError(
                f"sync_weights: unknown parameter names {unknown[:5]} (of {len(unknown)})"
            )
        for name, tensor in params.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"sync_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"the serving model expects {tuple(own[name].shape)}"
                )
        with self._lock, torch.no_grad():
            for name, tensor in params.items():
                own[name].copy_(tensor.to(own[name].device, own[name].dtype))
            self.policy_version = version
        return f"synced {len(params)} tensors as version {version}"

    # ---- batching -------------------------------------------------------------------------
    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let concurrent callers enqueue before the first batch
        while self._pending:
            batch = self._pending[: self.max_batch_size]
            del self._pending[: self.max_batch_size]
            try:
                responses = await asyncio.to_thread(self._generate, [r for r, _ in batch])
            except Exception as e:  # every waiter learns about the failure
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
            else:
                for (_, fut), resp in zip(batch, responses):
                    if not fut.done():
                        fut.set_result(resp)

    def _generate(self, requests: list[CompletionRequest]) -> list[ChatResponse]:
        with self._lock, torch.no_grad(), _eval_mode(self.model):
            version = self.policy_version
            rows = [
                _Row(
                    request=r,
                    generator=(
                        None
                        if r.sampling.seed is None
                        else torch.Generator().manual_seed(int(r.sampling.seed))
                    ),
                    tokens=[],
                    logprobs=[],
                )
                for r in requests
            ]
            self._sample(rows)
        return [self._response(row, version) for row in rows]

    def _sample(self, rows: list[_Row]) -> None:
        device = next(self.model.parameters()).device
        prompts = [list(r.request.prompt_token_ids) for r in rows]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every row's last token aligned
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        past = None
        max_new = max(r.request.sampling.max_tokens for r in rows)
        for _ in range(max_new):
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()  # [B, V]
            logp = torch.log_softmax(logits, dim=-1)
            next_ids = []
            for i, row in enumerate(rows):
                if row.finish_reason is not None:
                    next_ids.append(self.pad_token_id)
                    continue
                tok = _sample_token(logits[i], row.request.sampling, row.generator)
                row.tokens.append(tok)
                row.logprobs.append(float(logp[i, tok]))
                self._update_finish(row, tok)
                next_ids.append(tok)
            if all(r.finish_reason is not None for r in rows):
                break
            input_ids = torch.tensor(next_ids, device=device).unsqueeze(1)
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            positions = positions[:, -1:] + 1

    def _update_finish(self, row: _Row, tok: int) -> None:
        sampling = row.request.sampling
        if tok in self.eos_token_ids:
            row.finish_reason = "stop"
        elif sampling.stop:
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            if any(s in text for s in sampling.stop):
                row.finish_reason = "stop"
        if row.finish_reason is None and len(row.tokens) >= sampling.max_tokens:
            row.finish_reason = "length"

    def _response(self, row: _Row, version: int) -> ChatResponse:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        for s in row.request.sampling.stop:  # like vLLM: the stop string is not in the text
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        returns = row.request.returns
        trace = None
        if returns.return_token_ids:
            trace = TokenTrace(
                prompt_token_ids=row.request.prompt_token_ids,
                completion_token_ids=tuple(row.tokens),
                completion_logprobs=tuple(row.logprobs) if returns.return_logprobs else None,
                finish_reason=row.finish_reason,
                policy_version=version,
            )
        return ChatResponse(text=text, finish_reason=row.finish_reason, trace=trace)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Sample with dropout off (a model shared with the Trainer is left in train mode),
    then restore the model's mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _sample_token(logits: torch.Tensor, s: SamplingSpec, gen: torch.Generator | None) -> int:
    """Sample one token id from ``logits`` [V] under temperature / top-k / top-p."""
    if s.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / s.temperature
    if s.top_k > 0:
        kth = torch.topk(scores, min(s.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) > s.top_p  # keep the token crossing top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
