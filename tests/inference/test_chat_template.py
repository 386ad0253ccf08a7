"""HFChatTemplate: rendering, and in-turn extension that keeps earlier tokens exact."""

from __future__ import annotations

import pytest

from ludic.inference.chat_template import ChatTemplate, HFChatTemplate
from ludic.models.tiny import build_tiny_tokenizer

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
]
TOOL_RESULT = [{"role": "tool", "content": "5", "tool_call_id": "call_0", "name": "add"}]
ADD_SCHEMA = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture
def template(tiny_tokenizer) -> HFChatTemplate:
    return HFChatTemplate(tiny_tokenizer)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_hf_chat_template_satisfies_chat_template_protocol(template) -> None:
    assert isinstance(template, ChatTemplate)


def test_render_encodes_the_tokenizers_template_text(template, tiny_tokenizer) -> None:
    text = tiny_tokenizer.apply_chat_template(HISTORY, tokenize=False, add_generation_prompt=True)
    assert template.render(HISTORY) == _encode(tiny_tokenizer, text)
    assert template.decode(template.render(HISTORY)).endswith("<|im_start|>assistant\n")


def test_a_prompt_rendered_again_gives_the_same_tokens_from_the_kept_copy() -> None:
    template = HFChatTemplate(build_tiny_tokenizer())  # its own: the template is changed
    first = template.render(HISTORY)
    first.append(-1)  # the caller's list: changing it leaves the kept tokens alone
    template.tokenizer.chat_template = "changed"  # not read again for a kept prompt...
    assert template.render(HISTORY) == first[:-1]
    # ...while a prompt not rendered before is
    changed = _encode(template.tokenizer, "changed")
    assert template.render(HISTORY, add_generation_prompt=False) == changed


def test_render_without_generation_prompt_omits_assistant_header(template) -> None:
    text = template.decode(template.render(HISTORY, add_generation_prompt=False))
    assert not text.endswith("<|im_start|>assistant\n")


def test_render_with_tools_lists_schemas(template) -> None:
    assert '"name": "add"' in template.decode(template.render(HISTORY, tools=[ADD_SCHEMA]))


def test_extend_after_eos_does_not_repeat_eos_and_matches_full_render(
    template, tiny_tokenizer
) -> None:
    prompt = template.render(HISTORY)
    completion = _encode(tiny_tokenizer, "<tool_call>add</tool_call>") + [
        tiny_tokenizer.eos_token_id
    ]
    extended = template.extend(prompt, completion, TOOL_RESULT)

    assert extended[: len(prompt) + len(completion)] == prompt + completion
    full = HISTORY + [{"role": "assistant", "content": "<tool_call>add</tool_call>"}] + TOOL_RESULT
    assert extended == template.render(full)  # byte-level: text and tokens agree exactly
    assert extended.count(tiny_tokenizer.eos_token_id) == template.render(full).count(
        tiny_tokenizer.eos_token_id
    )


def test_extend_without_eos_closes_the_assistant_turn(template, tiny_tokenizer) -> None:
    prompt = template.render(HISTORY)
    completion = _encode(tiny_tokenizer, "cut off mid")  # e.g. finish_reason="length"
    extended = template.extend(prompt, completion, TOOL_RESULT)

    assert extended[: len(prompt) + len(completion)] == prompt + completion
    added = template.decode(extended[len(prompt) + len(completion) :])
    assert added == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_extend_does_not_mistake_a_text_byte_for_the_closing_token(
    template, tiny_tokenizer
) -> None:
    prompt = template.render(HISTORY)
    completion = _encode(tiny_tokenizer, "a <")  # '<' is a byte, not <|im_end|>
    extended = template.extend(prompt, completion, TOOL_RESULT)
    assert template.decode(extended[len(prompt) + len(completion) :]).startswith("<|im_end|>\n")


def test_extend_with_tools_matches_full_render_with_tools(template, tiny_tokenizer) -> None:
    prompt = template.render(HISTORY, tools=[ADD_SCHEMA])
    completion = _encode(tiny_tokenizer, "ok") + [tiny_tokenizer.eos_token_id]
    extended = template.extend(prompt, completion, TOOL_RESULT, tools=[ADD_SCHEMA])
    full = HISTORY + [{"role": "assistant", "content": "ok"}] + TOOL_RESULT
    assert extended == template.render(full, tools=[ADD_SCHEMA])


def test_extend_chains_over_several_calls(template, tiny_tokenizer) -> None:
    eos = tiny_tokenizer.eos_token_id
    p1 = template.render(HISTORY)
    c1 = _encode(tiny_tokenizer, "first") + [eos]
    p2 = template.extend(p1, c1, TOOL_RESULT)
    c2 = _encode(tiny_tokenizer, "second") + [eos]
    p3 = template.extend(p2, c2, [{"role": "user", "content": "go on"}])
    assert p3[: len(p2) + len(c2)] == p2 + c2
    assert p2[: len(p1) + len(c1)] == p1 + c1


def test_extend_rejects_a_template_that_is_not_prefix_stable() -> None:
    tokenizer = build_tiny_tokenizer()
    # Writes the message count first: appending messages rewrites the start of the prompt.
    tokenizer.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    template = HFChatTemplate(tokenizer)
    prompt = template.render(HISTORY)
    with pytest.raises(ValueError, match="not prefix-stable"):
        template.extend(prompt, _encode(tokenizer, "hi"), TOOL_RESULT)


def test_extend_handles_a_template_that_decorates_only_the_last_assistant_message() -> None:
    tokenizer = build_tiny_tokenizer()
    # Qwen3-style: an empty <think> block is inserted into the *last* assistant message
    # unless it already holds one.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last and '</think>' not in m['content'] %}"
        "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    template = HFChatTemplate(tokenizer)
    prompt = template.render(HISTORY)
    completion = _encode(tokenizer, "<think>\nhm\n</think>\n\nok") + [tokenizer.eos_token_id]
    extended = template.extend(prompt, completion, TOOL_RESULT)
    assert extended[: len(prompt) + len(completion)] == prompt + completion
    added = template.decode(extended[len(prompt) + len(completion) :])
    assert added == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_without_chat_template_is_rejected_at_construction() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        HFChatTemplate(tokenizer)
