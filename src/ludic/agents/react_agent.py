"""``ReActAgent``: [think -> tool]* -> act, with a final-answer shot clock.

Each model call may think and call tools (``<tool_call>`` blocks); a call without tool
calls is the final answer. What one ``act`` returns:

* ``action_target="env"`` -- the final answer, parsed by the action parser (or a parse
  failure with feedback);
* ``action_target="external"`` -- external tool calls for the protocol; it answers via
  ``on_tool_results`` and calls ``act`` again with the same ``turn_id``.

Internal tools run inside ``act`` (as in ``ToolAgent``), so ``act`` never returns
``"internal"``; the model calls that ran internal tools are the act's ``AgentStep``s with
``action_target="internal"``.

Shot clock: the model calls of a turn are counted across ``act`` calls (external round
trips included). Once ``max_react_steps`` calls of the turn ended without a final answer,
the agent appends ``{"role": "user", "content": final_answer_prompt}`` after the last tool
results and makes one more call. That call's tool calls are not run: its text goes to the
action parser as the final answer (a reply that is only a tool call then fails to parse),
and its step has ``info["forced_final_answer"] = True``. A turn thus makes at most
``max_react_steps + 1`` model calls. ``max_tool_calls`` still caps internal tool calls per
``act``.
"""

from __future__ import annotations

from typing import Any

from ludic.agents.tool_agent import ToolAgent

FINAL_ANSWER_PROMPT = (
    "You must answer now. Do not call any more tools; give your final answer in the "
    "required format."
)


class ReActAgent(ToolAgent):
    """A ``ToolAgent`` with a per-turn final-answer shot clock (see the module docstring).

    Args:
        max_react_steps: model calls per turn that may use tools before the agent forces a
            final answer (>= 1).
        final_answer_prompt: the user message that forces it.
        **tool_agent_kwargs: every ``ToolAgent`` argument (``client``, ``context``,
            ``parser``, ``chat_template``, ``tools``, ``external_tools``, ...).
    """

    def __init__(
        self,
        *,
        max_react_steps: int = 5,
        final_answer_prompt: str = FINAL_ANSWER_PROMPT,
        **tool_agent_kwargs: Any,
    ) -> None:
        super().__init__(**tool_agent_kwargs)
        if max_react_steps < 1:
            raise ValueError(
                f"ReActAgent: max_react_steps must be >= 1, got {max_react_steps}; it counts "
                "the model calls of a turn allowed to use tools before a forced final answer"
            )
        self.max_react_steps = max_react_steps
        self.final_answer_prompt = final_answer_prompt

    def _before_model_call(self, turn_id: str) -> bool:
        if self.model_calls_in_turn(turn_id) < self.max_react_steps:
            return False
        self.on_tool_results([{"role": "user", "content": self.final_answer_prompt}])
        return True
