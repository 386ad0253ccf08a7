"""Context strategies: how an agent's history becomes its next prompt."""

from ludic.context.base import ContextStrategy
from ludic.context.full_dialog import FullDialog
from ludic.context.truncated_thinking import TruncatedThinkingContext, truncate_thinking

__all__ = ["ContextStrategy", "FullDialog", "TruncatedThinkingContext", "truncate_thinking"]
