"""``Agent``: an LLM with state (chat client, context strategy, parser, chat template) that
implements ``ActingAgent``; one ``act`` is one model call. Subclasses (``ToolAgent``,
``ReActAgent``) loop over ``_call_model`` and end with ``_finish_with_parse`` or ``_fail``.

Token-in prompts: the first call of a turn renders ``context.on_before_act()`` with the
chat template; a later call of the same turn (same ``turn_id``, after tool results) uses
``chat_template.extend(prev_prompt, prev_completion, new_messages)``, so its prompt starts
with the previous call's exact tokens and a turn's calls form one training sequence (the
context strategy is not re-applied within a turn: that would change earlier tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ludic.context.base import ContextStrategy
from ludic.inference.chat_template import ChatTemplate
from ludic.inference.client import ChatClient
from ludic.inference.request import CompletionRequest, InferenceSpec
from ludic.parsers import Parser, ParseResult
from ludic.timing import timed
from ludic.types import (
    AgentAct,
    AgentStep,
    ChatResponse,
    ContractError,
    Info,
    Message,
    Observation,
    TokenTrace,
    logprob_temperature,
    new_id,
)

DEFAULT_PARSE_FEEDBACK = "Your output could not be parsed. Answer in the required format."

INCOMPLETE_FEEDBACK = (
    "Your output was cut off at the token limit before it finished. "
    "Answer more concisely so the whole answer fits."
)


@dataclass
class _Turn:
    """The model calls of the current turn so far, for in-turn prompt extension."""

    turn_id: str
    prompt_ids: list[int]
    completion_ids: list[int] | None  # None when the backend returned no token trace
    messages: list[Message]  # what the last call saw, plus its assistant message
    model_calls: int
    pending: list[Message] = field(default_factory=list)  # added since the last call


class Agent:
    """An LLM policy with memory, parsing and a chat template.

    Each model call becomes an ``AgentStep`` (``index=-1``: the protocol sets it) with the
    prompt messages, the completion text, the ``TokenTrace``, the parser's reward and
    whether parsing failed. ``act`` returns ``AgentAct(action_target="env")``.

    Args:
        client: the inference backend.
        context: the memory / prompt policy; it receives every hook.
        parser: completion text -> ``ParseResult`` (action + format reward).
        chat_template: renders messages to prompt token ids and extends in-turn prompts.
        incomplete_completion_penalty: when set, a completion with
            ``finish_reason == "length"`` is not parsed: it is a parse failure with this
            reward and feedback asking for a shorter answer (so truncated actions are not
            trained on as if valid). ``None`` parses truncated completions as usual.

    Every request of one episode (from one ``on_env_reset`` to the next) carries the same
    ``session_id``, so a server pool keeps the episode on one server (prefix cache). A
    step's ``info["server"]`` names the server that produced it, when the client says.
    """

    def __init__(
        self,
        *,
        client: ChatClient,
        context: ContextStrategy,
        parser: Parser,
        chat_template: ChatTemplate,
        incomplete_completion_penalty: float | None = None,
    ) -> None:
        self.client = client
        self.context = context
        self.parser = parser
        self.chat_template = chat_template
        self.incomplete_completion_penalty = incomplete_completion_penalty
        self._turn: _Turn | None = None
        self._session_id = new_id()

    # ---- ActingAgent ------------------------------------------------------------------
    def on_env_reset(
        self, obs: Observation, info: Info, *, system_prompt: str | None = None
    ) -> None:
        self.context.on_env_reset(obs, info, system_prompt=system_prompt)
        self._turn = None
        self._session_id = new_id()

    def on_tool_results(self, messages: list[Message]) -> None:
        """Add tool results (or other messages) to the history; the next ``act`` of the
        same turn appends them to the previous prompt + completion tokens."""
        self.context.on_tool_results(messages)
        if self._turn is not None:
            self._turn.pending.extend(dict(m) for m in messages)

    def on_after_step(self, obs: Observation, info: Info) -> None:
        self.context.on_after_step(obs, info)
        self._turn = None

    async def act(self, *, inference: InferenceSpec, turn_id: str) -> AgentAct:
        step = await self._call_model(inference, turn_id)
        return self._finish_with_parse([step])

    # ---- building blocks for subclasses -----------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """Tool schemas passed to the chat template (``None``: no tools)."""
        return None

    def model_calls_in_turn(self, turn_id: str) -> int:
        """Model calls made so far in turn ``turn_id``."""
        turn = self._turn
        return turn.model_calls if turn is not None and turn.turn_id == turn_id else 0

    async def _call_model(self, inference: InferenceSpec, turn_id: str) -> AgentStep:
        """One model call: build the prompt, complete, record the assistant message.

        The returned step is unparsed (``action=None``); ``info["finish_reason"]`` holds
        the completion's finish reason and ``info["tools"]`` the tool schemas the prompt
        was rendered with (when there are any), so ``retokenize=True`` can render it again.
        """
        calls_before = self.model_calls_in_turn(turn_id)
        tools = self.tool_schemas()
        prompt_ids, messages = self._next_prompt(turn_id, tools)
        request = CompletionRequest(
            prompt_token_ids=tuple(prompt_ids), inference=inference, session_id=self._session_id
        )
        response = await self.client.complete(request)
        trace = self._checked_trace(request, response)

        assistant: Message = {"role": "assistant", "content": response.text}
        self.context.on_after_act(assistant)
        self._turn = _Turn(
            turn_id=turn_id,
            prompt_ids=list(prompt_ids),
            completion_ids=None if trace is None else list(trace.completion_token_ids),
            messages=[*messages, assistant],
            model_calls=calls_before + 1,
        )
        info: Info = {"finish_reason": response.finish_reason}
        if "server" in response.meta:
            info["server"] = response.meta["server"]
        if response.meta.get("discarded_tokens"):  # a restart threw these away (the ledger)
            info["discarded_tokens"] = response.meta["discarded_tokens"]
        if tools:
            info["tools"] = tools
        return AgentStep(
            index=-1,
            turn_id=turn_id,
            prompt_messages=messages,
            completion=response.text,
            trace=trace,
            info=info,
        )

    def _finish_with_parse(self, steps: list[AgentStep]) -> AgentAct:
        """Parse the last step's completion into the act's env action."""
        step = steps[-1]
        result = self._parse(step)
        step.action_target = "env"
        step.action = result.action
        step.reward = result.reward
        if result.ok:
            return AgentAct(steps=steps, action=result.action, action_target="env")
        return self._fail(steps, result.reward, result.obs or DEFAULT_PARSE_FEEDBACK)

    def _fail(self, steps: list[AgentStep], reward: float, feedback: str) -> AgentAct:
        """End the act with a parse failure: no action, ``feedback`` for a synthetic step,
        ``reward`` (a penalty) on the last step."""
        step = steps[-1]
        step.action = None
        step.action_target = "env"
        step.reward = reward
        step.parse_error = True
        step.info["parse_feedback"] = feedback
        return AgentAct(
            steps=steps, action=None, action_target="env", parse_error=True, feedback_obs=feedback
        )

    # ---- helpers ----------------------------------------------------------------------
    def _parse(self, step: AgentStep) -> ParseResult:
        penalty = self.incomplete_completion_penalty
        if penalty is not None and step.info.get("finish_reason") == "length":
            step.info["incomplete_completion"] = True
            return ParseResult(action=None, reward=penalty, obs=INCOMPLETE_FEEDBACK)
        with timed("parser"):
            result = self.parser(step.completion)
        if not isinstance(result, ParseResult):
            name = getattr(self.parser, "__qualname__", type(self.parser).__name__)
            raise ContractError(
                f"parser {name} returned {result!r} ({type(result).__name__}) for "
                f"{step.completion[:40]!r}; a parser must return a ParseResult "
                "(action=None for a parse failure)"
            )
        return result

    def _next_prompt(
        self, turn_id: str, tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], list[Message]]:
        """``(prompt ids, prompt messages)``: extend the turn's last call when continuing
        it with new messages, else render the context strategy's view."""
        turn = self._turn
        if turn is not None and turn.turn_id == turn_id and turn.pending:
            messages = [*turn.messages, *turn.pending]
            if turn.completion_ids is None:  # no trace (e.g. eval): text-mode render
                return self.chat_template.render(messages, tools=tools), messages
            ids = self.chat_template.extend(
                turn.prompt_ids, turn.completion_ids, turn.pending, tools=tools
            )
            return ids, messages
        messages = self.context.on_before_act()
        return self.chat_template.render(messages, tools=tools), messages

    def _checked_trace(
        self, request: CompletionRequest, response: ChatResponse
    ) -> TokenTrace | None:
        client = type(self.client).__name__
        trace = response.trace
        if not request.returns.return_token_ids:
            return trace
        if trace is None:
            raise RuntimeError(
                f"{client}.complete returned no token trace, but the request's ReturnSpec "
                "has return_token_ids=True; the client must return ChatResponse.trace with "
                "the completion token ids (or use ReturnSpec.for_eval() when not training)"
            )
        if request.returns.return_logprobs and not trace.has_logprobs:
            raise RuntimeError(
                f"{client}.complete returned a trace without completion_logprobs, but the "
                "request's ReturnSpec has return_logprobs=True; the client must return "
                "chosen-token logprobs (or set ReturnSpec(return_logprobs=False))"
            )
        if trace.prompt_token_ids and trace.prompt_token_ids != request.prompt_token_ids:
            raise RuntimeError(
                f"{client}.complete returned prompt_token_ids that differ from the request's "
                f"({len(trace.prompt_token_ids)} vs {len(request.prompt_token_ids)} tokens); "
                "the backend must consume the prompt token ids as given, not re-tokenize"
            )
        expected = logprob_temperature(request.sampling.temperature)
        if trace.logprob_temperature != expected:
            raise RuntimeError(
                f"{client}.complete returned a trace with logprob_temperature="
                f"{trace.logprob_temperature} for a request sampled at temperature "
                f"{request.sampling.temperature}; the trainer scores the tokens under "
                f"softmax(logits / logprob_temperature), so the client must set it to "
                f"{expected} (ludic.types.logprob_temperature) with logprobs of that policy"
            )
        return trace
