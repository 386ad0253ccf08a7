"""An in-process ``ChatClient`` on a transformers causal LM: the embedded counterpart of a
vLLM server.

Concurrent ``complete`` calls are gathered into one left-padded batch and sampled
together with a KV cache, in eval mode (no dropout; the model's mode is restored after).
Returned logprobs are those of the chosen tokens under the distribution they were drawn
from (log-softmax after temperature, top-k and top-p; of the raw logits for greedy
requests), the quantity ludic's vLLM server returns (``processed_logprobs``); the trace's
``logprob_temperature`` tells the trainer to score the tokens at that temperature.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ludic._async import on_compute_thread, raise_if_abandoned
from ludic.distributed.weight_transfer.verify import check_copy
from ludic.inference.batch_sampling import RowNoise, RowSampling, sample_next_tokens
from ludic.inference.kv_decoder import KVDecoder, decoder_problem
from ludic.inference.request import CompletionRequest
from ludic.timing import timed
from ludic.types import ChatResponse, TokenTrace, logprob_temperature


@dataclass
class _Row:
    request: CompletionRequest
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


class TransformersChatClient:
    """Token-in completions from a local HF causal LM.

    Args:
        model: a causal LM (``AutoModelForCausalLM``); used under ``torch.no_grad``.
        tokenizer: decodes completions and supplies the EOS id.
        eos_token_ids: token ids that end a completion (default: the tokenizer's EOS).
        max_batch_size: most requests sampled together.
        policy_version: the version reported until the first ``sync_weights``.
        verify_sync: read the weights back after ``sync_weights`` and check their
            checksums against the trainer's (``ludic.distributed.weight_transfer.verify``):
            ``"every"`` sync (default), the ``"first"`` only, or ``"off"``.
        lean_decode: decode with :class:`~ludic.inference.kv_decoder.KVDecoder` when it
            serves the model (``decode`` then reads ``"lean"``; the model's own forward,
            ``"transformers"``, otherwise or when False).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_size: int = 32,
        policy_version: int = 0,
        verify_sync: str = "every",
        lean_decode: bool = True,
    ) -> None:
        if verify_sync not in ("every", "first", "off"):
            raise ValueError(f"verify_sync={verify_sync!r}; expected 'every', 'first' or 'off'")
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
        self.decode = "lean" if lean_decode and decoder_problem(model) is None else "transformers"
        self.policy_version = policy_version
        self.verify_sync = verify_sync
        self.syncs = 0
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
            if self.verify_sync == "every" or (self.verify_sync == "first" and not self.syncs):
                check_copy(params, own, where="the in-process inference model", version=version)
            self.syncs += 1
            self.policy_version = version
        return f"synced {len(params)} tensors as version {version}"

    # ---- batching -------------------------------------------------------------------------
    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let concurrent callers enqueue before the first batch
        while self._pending:
            batch = self._pending[: self.max_batch_size]
            del self._pending[: self.max_batch_size]
            try:
                responses = await on_compute_thread(self._generate, [r for r, _ in batch])
            except Exception as e:  # every waiter learns about the failure
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
            else:
                for (_, fut), resp in zip(batch, responses):
                    if not fut.done():
                        fut.set_result(resp)

    def _generate(self, requests: list[CompletionRequest]) -> list[ChatResponse]:
        with timed("sample"), self._lock, torch.no_grad(), _eval_mode(self.model):
            version = self.policy_version
            rows = self._sample(requests)
        return [self._response(row, version) for row in rows]

    def _sample(self, requests: list[CompletionRequest]) -> list[_Row]:
        """Decode every request together with a KV cache: the distinct prompts are
        prefilled once, then, per step, one forward pass, one vectorized sampling call over
        the rows (:func:`sample_next_tokens`) and tensor-wide EOS / length checks; only
        rows with stop strings are decoded to text per step."""
        device = next(self.model.parameters()).device
        n = len(requests)
        # Each distinct prompt is prefilled once; its KV cache is then copied to every row
        # that asked for it (a GRPO group: one prompt, group_size rows).
        distinct: dict[tuple[int, ...], int] = {}
        group = [distinct.setdefault(tuple(r.prompt_token_ids), len(distinct)) for r in requests]
        width = max(len(p) for p in distinct)
        input_ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(distinct), width), dtype=torch.long)
        for i, p in enumerate(distinct):  # left padding keeps every row's last token aligned
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        rows = torch.tensor(group, device=device)
        sampling = RowSampling.from_specs([r.sampling for r in requests])
        budget = torch.tensor([r.sampling.max_tokens for r in requests])
        max_new = int(budget.max())
        eos = torch.tensor(sorted(self.eos_token_ids))
        with_stop = [i for i, r in enumerate(requests) if r.sampling.stop]
        tokens = torch.full((n, max_new), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((n, max_new))
        lengths = torch.zeros(n, dtype=torch.long)  # tokens generated per row
        stopped = torch.zeros(n, dtype=torch.bool)  # EOS or a stop string
        done = budget <= 0
        next_logits = self._decoder(input_ids, attention, rows, width + max_new)
        noise = None
        chosen: torch.Tensor | None = None  # the previous step's tokens
        for t in range(max_new):
            raise_if_abandoned()
            logits = next_logits(chosen).float().cpu()  # [B, V]
            if noise is None:
                noise = RowNoise(sampling.generators, logits.shape[-1], max_new)
            chosen, chosen_logp = sample_next_tokens(logits, sampling, noise.next())
            live = ~done
            chosen = torch.where(live, chosen, self.pad_token_id)
            tokens[:, t] = chosen
            logprobs[:, t] = chosen_logp
            lengths += live.long()
            stopped |= live & torch.isin(chosen, eos)
            for i in with_stop:
                if live[i] and not stopped[i]:
                    text = self.tokenizer.decode(tokens[i, : lengths[i]], skip_special_tokens=True)
                    stopped[i] = any(s in text for s in requests[i].sampling.stop)
            done = stopped | (lengths >= budget)
            if bool(done.all()):
                break
        return [
            _Row(
                request=r,
                tokens=tokens[i, : lengths[i]].tolist(),
                logprobs=logprobs[i, : lengths[i]].tolist(),
                finish_reason="stop" if stopped[i] else "length",
            )
            for i, r in enumerate(requests)
        ]

    def _decoder(
        self, input_ids: torch.Tensor, attention: torch.Tensor, rows: torch.Tensor, capacity: int
    ) -> Callable[[torch.Tensor | None], torch.Tensor]:
        """``next_logits(chosen)``: the logits ``[B, V]`` after the tokens ``chosen`` ``[B]``
        (None: after the prompts). The prompts ``input_ids`` (left-padded, one row per
        distinct prompt) are prefilled on the first call, then expanded to one row per
        request by ``rows``. A :class:`KVDecoder` decodes models it serves; other models
        decode through their own forward with a transformers cache."""
        if self.decode == "lean":
            decoder = KVDecoder(self.model, capacity)

            def lean(chosen: torch.Tensor | None) -> torch.Tensor:
                if chosen is not None:
                    return decoder.step(chosen.to(input_ids.device))
                logits = decoder.prefill(input_ids, attention)
                decoder.select(rows)
                return logits[rows]

            return lean
        state: dict[str, Any] = {"attention": attention, "past": None}

        def forward(chosen: torch.Tensor | None) -> torch.Tensor:
            attention = state["attention"]
            if chosen is None:
                ids, positions = input_ids, (attention.cumsum(-1) - 1).clamp(min=0)
            else:
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
                ids, positions = chosen.to(input_ids.device)[:, None], state["positions"] + 1
            out = self.model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=state["past"],
                use_cache=True,
            )
            logits, past = out.logits[:, -1, :], out.past_key_values
            positions = positions[:, -1:]
            if chosen is None:  # from one row per distinct prompt to one per request
                past.reorder_cache(rows)
                logits, attention, positions = logits[rows], attention[rows], positions[rows]
            state.update(attention=attention, past=past, positions=positions)
            return logits

        return forward

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
                logprob_temperature=logprob_temperature(row.request.sampling.temperature),
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
