"""wandb and TensorBoard from config, with the real packages: one wandb run (offline mode)
spans the warm start, RL, the evaluations and a resume, and holds the resolved config;
TensorBoard's event files, read back, hold every phase's metrics at their steps."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from ludic.cli import main

TINY_RUN = """\
name: loggers
output_dir: {runs}
model: {{tiny: {{hidden_size: 64}}}}
env: {{kind: arithmetic, kwargs: {{num_problems: 20}}}}
sampling: {{max_tokens: 2}}
warm_start: {{steps: 2, num_demos: 8, batch_size: 4}}
algorithm: {{group_size: 2}}
trainer: {{steps: 2, prompts_per_step: 2, checkpoint_every: 1}}
eval: {{num_problems: 3, every: 1}}
logging: {{{logging}}}
"""


def _train(tmp_path: Path, logging: str, *argv: str) -> Path:
    config = tmp_path / "run.yaml"
    config.write_text(TINY_RUN.format(runs=tmp_path / "runs", logging=logging))
    assert main(["train", str(config), *argv]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    return run


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- wandb ------------------------------------------------------------------------------
def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log chunks (crc32c, length, type; 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    at, pending = header, b""
    while at + header <= len(data):
        left = block - at % block
        if left < header:
            at += left
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + header])
        if kind == 0:  # zero padding at the end of a block
            at += left
            continue
        chunk = data[at + header : at + header + length]
        at += header + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or last of several
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _key(item) -> str:
    """A history or config key: ``key``, or ``nested_key`` for keys holding a ``/``."""
    return item.key or "/".join(item.nested_key)


def _wandb_run(folder: Path) -> tuple[str, dict, list[dict]]:
    """(run id, config, history rows) of an offline run folder."""
    (file,) = folder.glob("run-*.wandb")
    run_id, config, history = "", {}, []
    for record in _wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({_key(u): json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
    return run_id, config, history


def test_one_offline_wandb_run_spans_every_phase_and_the_resume(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logging = "wandb: true, wandb_mode: offline, wandb_project: ludic-test"
    run = _train(tmp_path, logging)
    (first,) = (run / "wandb").glob("offline-run-*")
    run_id, config, history = _wandb_run(first)
    assert run_id == (run / "wandb_run_id").read_text().strip()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert {k: v for k, v in config.items() if k != "_wandb"} == saved  # the resolved config

    metrics = _metrics(run)
    for record in metrics:  # every metrics.jsonl record, under its phase, at its step
        phase = record["phase"]
        rows = [h for h in history if h.get(f"{phase}/step") == record["step"]]
        numeric = {k: v for k, v in record.items() if isinstance(v, float) and k not in ("step",)}
        assert any(
            all(row.get(f"{phase}/{k}") == pytest.approx(v) for k, v in numeric.items())
            for row in rows
        ), (phase, record["step"])
    phases = {k.split("/")[0] for h in history for k in h if not k.startswith("_")}
    assert phases == {"warm_start", "rl", "eval", "ledger"}  # ledger: settled at the end

    # a resumed run continues the same wandb run
    assert main(["train", "--resume", str(run), str(run / "config.yaml"), "trainer.steps=3"]) == 0
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    resumed_id, _, resumed = _wandb_run(next(f for f in folders if f != first))
    assert resumed_id == run_id
    assert any(h.get("rl/step") == 3 for h in resumed)


# ---- TensorBoard --------------------------------------------------------------------------
def test_tensorboard_event_files_hold_every_phase(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _train(tmp_path, "tensorboard: true")
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    metrics = _metrics(run)
    for record in metrics:
        for key in ("loss", "success_rate", "batch/reward_mean"):
            if isinstance(record.get(key), float):
                tag = f"{record['phase']}/{key}"
                assert tag in tags
                at_step = [e.value for e in events.Scalars(tag) if e.step == record["step"]]
                assert at_step and at_step[-1] == pytest.approx(record[key], rel=1e-6)
    assert {t.split("/")[0] for t in tags} == {"warm_start", "rl", "eval", "ledger"}
    assert not (run / "wandb").exists()


def test_a_missing_logger_package_is_named(tmp_path, monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    config = tmp_path / "run.yaml"
    config.write_text(TINY_RUN.format(runs=tmp_path / "runs", logging="wandb: true"))
    assert main(["train", str(config)]) != 0
    err = capsys.readouterr().err
    assert "logging.wandb" in err and "ludic-rl[wandb]" in err


def test_a_torn_wandb_run_id_file_gets_a_fresh_id(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from ludic.run.loading import load_config
    from ludic.run.run_dir import RunDirectory
    from ludic.run.run_loggers import WANDB_ID_FILE, WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDirectory.create(tmp_path, "torn")
    (run.path / WANDB_ID_FILE).write_text("")  # a crash while it was first written
    config = load_config(None, ["logging.wandb=true", "logging.wandb_mode=offline"])
    sink = WandbSink(config, run)
    sink.close()
    run_id = (run.path / WANDB_ID_FILE).read_text().strip()
    assert len(run_id) == 16
    assert [p.name.endswith(run_id) for p in (run.path / "wandb").glob("offline-run-*")] == [True]
