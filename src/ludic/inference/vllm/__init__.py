"""ludic on vLLM: servers, their worker extension, clients and process helpers.

* ``server`` / ``reward_server``: the policy server (vLLM's OpenAI app plus ludic's control
  plane, ``control``) and the reward-model server (``POST /score``); ``worker``: their worker
  extension; ``client`` / ``reward_client`` / ``pool``: the clients (``http``, ``weight_sync``);
* ``admission``: exact versions per request; ``partial``: completions aborted by an update;
  ``process``: a server as a subprocess; ``logits_processors``: the ``max_think`` budget.

Importing this package does not import vLLM; only the server and worker modules do.
"""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "VLLMChatClient": "ludic.inference.vllm.client",
    "VLLMRewardClient": "ludic.inference.vllm.reward_client",
    "VLLMConnection": "ludic.inference.vllm.client",
    "VLLMServerError": "ludic.inference.vllm.http",
    "PartialRolloutError": "ludic.inference.vllm.partial",
    "start_vllm_server": "ludic.inference.vllm.process",
    "wait_for_vllm_health": "ludic.inference.vllm.process",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
