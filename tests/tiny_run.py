"""Overrides for a two-step ``ludic train`` on the smallest tiny model (a run that checks
wiring, not learning)."""

TINY_RUN = [
    "model.tiny={hidden_size: 64, num_layers: 1, num_heads: 1, seed: 0}",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "algorithm.group_size=2",
    "eval.num_problems=2",
    "logging.console_every=1",
    "sampling.max_tokens=4",
]
