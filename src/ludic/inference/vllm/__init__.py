"""ludic on vLLM: servers, their worker extension, clients and process helpers.

* ``server``: the policy server (vLLM's OpenAI app plus ludic's control plane:
  weight sync, versions, pause/resume, ``max_think``); ``python -m ludic.inference.vllm.server``;
* ``reward_server``: the reward-model server (``POST /score``), same control plane;
* ``worker``: the worker extension that joins the trainer's group and loads weights;
* ``client`` / ``reward_client``: ``VLLMChatClient`` and ``VLLMRewardClient``;
* ``http``: the HTTP plumbing both clients share; ``weight_sync``: their weight-sync session;
* ``admission``: exact policy versions per request (the admission gate, version headers);
* ``partial``: continuing or restarting completions aborted by a weight update;
* ``process``: start a server as a subprocess and wait for it (``start_vllm_server``);
* ``logits_processors``: the ``max_think`` budget.

Importing this package does not import vLLM; only the server and worker modules do.
"""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "VLLMChatClient": "ludic.inference.vllm.client",
    "VLLMRewardClient": "ludic.inference.vllm.reward_client",
    "VLLMConnection": "ludic.inference.vllm.weight_sync",
    "VLLMServerError": "ludic.inference.vllm.http",
    "PartialRolloutError": "ludic.inference.vllm.partial",
    "start_vllm_server": "ludic.inference.vllm.process",
    "wait_for_vllm_health": "ludic.inference.vllm.process",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
