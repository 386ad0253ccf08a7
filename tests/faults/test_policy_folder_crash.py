"""``RUN_DIR/policy`` under crashes: a process writing the policy folder over and over is
killed with SIGKILL at random moments, and the folder is always a complete Hugging Face
folder holding one whole version of the weights (never a mix, never missing); what a
killed write leaves behind is cleaned by the next write. The fallback swap (two renames,
where ``renameat2`` cannot exchange) is repaired after a crash between its renames."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ludic.run import export
from ludic.run.export import recover_policy_folder, save_policy_folder

WRITER = textwrap.dedent(
    """
    import sys, torch
    from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer
    from ludic.run.export import save_policy_folder
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=0)
    version = int(sys.argv[2])
    while True:
        version += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(version / 1000)
        save_policy_folder(model, tokenizer, sys.argv[1])
        print(version, flush=True)
    """
)


def _version(folder: Path) -> int:
    """The one version every weight of the folder holds (asserts they agree)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    values = {round(float(v) * 1000) for p in model.parameters() for v in p.unique()}
    assert len(values) == 1, f"weights from several versions: {sorted(values)[:5]}"
    return values.pop()


def test_sigkill_at_random_moments_never_leaves_a_torn_policy_folder(tmp_path) -> None:
    out = tmp_path / "run" / "policy"
    rng = random.Random(0)
    last_saved = 0
    for _ in range(5):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(out), str(last_saved)],
            stdout=subprocess.PIPE,
            text=True,
        )
        first = writer.stdout.readline()  # one complete write, then kill at a random moment
        assert first.strip(), "the writer died before its first save"
        time.sleep(rng.uniform(0.0, 0.4))
        writer.send_signal(signal.SIGKILL)
        printed = [int(first), *map(int, writer.stdout.read().split())]
        writer.wait(timeout=30)
        version = _version(out)
        # the folder is a whole version: the last one reported saved or the one after it
        # (written and swapped in, killed before it could print)
        assert version in (printed[-1], printed[-1] + 1), (version, printed[-3:])
        last_saved = version
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name != "policy")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    save_policy_folder(model, _tokenizer(), out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["policy"], leftovers


def _tokenizer():
    from ludic.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_the_fallback_swap_is_repaired_after_a_crash_between_its_renames(
    tmp_path, tiny_model, tiny_tokenizer, monkeypatch
) -> None:
    monkeypatch.setattr(export, "_exchange", lambda a, b: False)  # a filesystem without it
    out = tmp_path / "policy"
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.fill_(0.007)
    save_policy_folder(tiny_model, tiny_tokenizer, out)
    save_policy_folder(tiny_model, tiny_tokenizer, out)  # the two-rename path
    assert _version(out) == 7 and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]

    out.rename(tmp_path / ".policy-old")  # the crash: old moved aside, new not yet in place
    recover_policy_folder(out)
    assert _version(out) == 7 and not (tmp_path / ".policy-old").exists()

    out.rename(tmp_path / ".policy-old")
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.fill_(0.008)
    save_policy_folder(tiny_model, tiny_tokenizer, out)  # the next write repairs, then swaps
    assert _version(out) == 8 and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
