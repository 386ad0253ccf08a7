"""``ReActAgent``: [think -> tool]* -> act, a ``ToolAgent`` with a final-answer shot clock.

A model call without tool calls is the final answer (``action_target="env"``); internal
tools run inside ``act`` as in ``ToolAgent``, external ones go to the protocol
(``action_target="external"``), which continues the turn. The shot clock counts a turn's
model calls across ``act`` calls: after ``max_react_steps`` without a final answer the agent
appends ``final_answer_prompt`` as a user message and makes one last call, whose tool calls
are not run (its text is parsed as the answer; ``info["forced_final_answer"] = True``), so
a turn makes at most ``max_react_steps + 1`` calls.
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
