"""Chat templates: messages -> prompt token ids, and in-turn prompt extension.

``extend`` is what keeps a multi-call turn drift-free: the next prompt within a turn is
the previous prompt + the exact completion tokens + the tokens of the new messages, so
all calls of a turn concatenate into one training sequence.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Protocol, runtime_checkable

from ludic.timing import timed
from ludic.types import Message


@runtime_checkable
class ChatTemplate(Protocol):
    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered as a prompt."""
        ...

    def extend(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The next prompt of the same turn. Must start with ``prompt_ids + completion_ids``."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...


RENDERED_KEPT = 1024
"""How many distinct rendered prompts :meth:`HFChatTemplate.render` keeps."""

_PROBE_USER = "ludic-probe-user"
_PROBE_ASSISTANT = "ludic-probe-assistant-7f3a"
_PROBE_CONTENTS = (_PROBE_ASSISTANT, f"<think>\nludic-probe\n</think>\n\n{_PROBE_ASSISTANT}")
"""Assistant contents tried in order. The second serves templates that render the last
assistant message differently unless it holds a reasoning block (Qwen3 inserts an empty
``<think>`` block there)."""


class HFChatTemplate:
    """A ``ChatTemplate`` backed by a Hugging Face tokenizer's Jinja chat template.

    ``render`` renders text with ``tokenizer.apply_chat_template(..., tokenize=False)`` and
    encodes it with ``add_special_tokens=False`` (the template already writes every control
    token).

    ``extend`` never re-tokenizes earlier tokens. It derives the text to append by rendering
    a two-message probe conversation (a user message and an assistant message; see
    ``_PROBE_CONTENTS``) and diffing:

    * ``closing`` -- what the template writes after an assistant message's content (ChatML:
      ``"<|im_end|>\\n"``);
    * ``rest`` -- what ``render(probe + new_messages, add_generation_prompt=True)`` adds
      after ``render(probe)``: the new messages and the generation prompt.

    The appended tokens are ``encode(closing + rest)`` minus the longest head that the
    completion already ends with (a completion that stopped on the EOS token
    ``<|im_end|>`` produced that token itself, so only ``"\\n"`` and the rest are added).
    Templates whose rendering of earlier messages changes when messages are appended (e.g.
    ones that strip earlier ``<think>`` blocks) fail the diff and raise ``ValueError``.

    ``render`` keeps the tokens of the last :data:`RENDERED_KEPT` distinct prompts (a GRPO
    group asks for one prompt ``group_size`` times); a template whose text depends on
    anything but its arguments (one that writes today's date) is re-rendered only once the
    prompt has left that window.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"HFChatTemplate: tokenizer {type(tokenizer).__name__} has no chat_template; "
                "set tokenizer.chat_template to a Jinja template string first"
            )
        self.tokenizer = tokenizer
        self._rendered: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def render_text(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for ``messages`` (what ``render`` encodes)."""
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        with timed("template"):
            return self._render(messages, tools, add_generation_prompt)

    def extend(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        with timed("template"):
            closing, rest = self._continuation_text(new_messages, tools)
            tail = self._encode(closing + rest)
            overlap = self._produced_overlap(list(completion_ids), tail, closing)
        return list(prompt_ids) + list(completion_ids) + tail[overlap:]

    def decode(self, token_ids: list[int]) -> str:
        """The exact text of ``token_ids``, control tokens included."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    # ---- helpers ----------------------------------------------------------------------
    def _render(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, generation: bool
    ) -> list[int]:
        try:  # a GRPO group renders one prompt group_size times: the tokens are kept
            key = json.dumps([messages, tools, generation], sort_keys=True)
        except (TypeError, ValueError):  # content JSON cannot write: rendered each time
            key = None
        with self._lock:
            kept = self._rendered.get(key) if key is not None else None
        if kept is not None:
            return list(kept)
        ids = self._encode(
            self.render_text(messages, tools=tools, add_generation_prompt=generation)
        )
        if key is not None:
            with self._lock:
                self._rendered[key] = tuple(ids)
                if len(self._rendered) > RENDERED_KEPT:  # the oldest goes first
                    del self._rendered[next(iter(self._rendered))]
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _continuation_text(
        self, new_messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> tuple[str, str]:
        """``(closing, rest)``: the assistant turn's closing text, then the new messages'
        text with the generation prompt, from diffing renders of a probe conversation."""
        for content in _PROBE_CONTENTS:
            probe: list[Message] = [
                {"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": content},
            ]
            closed = self.render_text(probe, tools=tools, add_generation_prompt=False)
            extended = self.render_text(
                probe + [dict(m) for m in new_messages], tools=tools, add_generation_prompt=True
            )
            at = closed.rfind(_PROBE_ASSISTANT)
            if at < 0:
                raise ValueError(
                    "HFChatTemplate.extend: the chat template did not write the assistant "
                    "message's content verbatim, so the assistant turn's closing text cannot "
                    "be found; use a template that renders assistant 'content' as-is"
                )
            if extended.startswith(closed):
                return closed[at + len(_PROBE_ASSISTANT) :], extended[len(closed) :]
        raise ValueError(
            "HFChatTemplate.extend: the chat template is not prefix-stable: rendering "
            f"{[m.get('role') for m in new_messages]} after an assistant message changes the "
            "text of the earlier messages, so in-turn prompts cannot extend the previous "
            "prompt + completion tokens. Use a template that renders history append-only "
            "(e.g. one that does not strip earlier <think> blocks)"
        )

    def _produced_overlap(self, completion_ids: list[int], tail: list[int], closing: str) -> int:
        """How many leading ``tail`` tokens the completion already ends with.

        Only tokens that lie inside the closing text count (a completion that ended on the
        EOS token closed its own turn); the new messages are never assumed produced.
        """
        best = 0
        for k in range(1, min(len(completion_ids), len(tail)) + 1):
            if not closing.startswith(self.decode(tail[:k])):
                break
            if completion_ids[-k:] == tail[:k]:
                best = k
        return best
