"""``env.kind: dataset_qa`` reads local JSONL / JSON / Parquet / CSV files and ``hf:NAME``
datasets (offline, from the local cache) through ``datasets``, maps fields, holds out an
evaluation part, and checks every answer with the chosen verifier (``math`` through
``math-verify``) before the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ludic.envs.dataset_source import load_records, split_holdout
from ludic.run.parts import dataset_qa_env_from_file

datasets = pytest.importorskip("datasets", reason="the data extra (datasets) is not installed")

ROWS = [
    {"problem": "What is 1/2 + 1/4?", "solution": "\\frac{3}{4}", "level": 1},
    {"problem": "Solve 2x = 6.", "solution": "3", "level": 1},
    {"problem": "The interval where 0 < x <= 1?", "solution": "(0, 1]", "level": 2},
]


def _write(path: Path, rows: list[dict]) -> Path:
    dataset = datasets.Dataset.from_list(rows)
    if path.suffix == ".parquet":
        dataset.to_parquet(str(path))
    elif path.suffix == ".csv":
        dataset.to_csv(str(path), index=False)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))  # a JSON array of records
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_file_format_loads_with_field_mapping_and_scores(tmp_path, suffix) -> None:
    data = _write(tmp_path / f"qa{suffix}", ROWS)
    env = dataset_qa_env_from_file(
        path=str(data),
        verifier="math",
        question_key="problem",
        answer_key="solution",
        prompt_template="(level {level}) {question}",
    )
    assert [str(s["solution"]) for s in env.samples] == [r["solution"] for r in ROWS]
    obs = env.reset(seed=0)["agent_0"][0]
    assert obs == "(level 1) What is 1/2 + 1/4?"
    assert env.step({"agent_0": "0.75"})["agent_0"].reward == 1.0
    env.reset(seed=2)
    assert env.step({"agent_0": "\\left(0, 1\\right]"})["agent_0"].reward == 1.0
    env.reset(seed=1)
    assert env.step({"agent_0": "4"})["agent_0"].reward == 0.0


def test_a_bad_row_is_named_before_the_run(tmp_path) -> None:
    rows = [*ROWS, {"problem": "p", "solution": "???"}]
    data = _write(tmp_path / "qa.parquet", rows)
    with pytest.raises(ValueError, match=r"qa.parquet row 4: solution='\?\?\?' is not an"):
        dataset_qa_env_from_file(
            path=str(data), verifier="math", question_key="problem", answer_key="solution"
        )
    with pytest.raises(ValueError, match=r"qa.parquet row 1: no key 'question'.*question_key"):
        dataset_qa_env_from_file(path=str(data), verifier="exact", answer_key="solution")


def test_unknown_suffix_missing_file_and_misplaced_subset_are_clear(tmp_path) -> None:
    (tmp_path / "qa.txt").write_text("1+1=2\n")
    with pytest.raises(ValueError, match=r"env.kwargs.path: .*qa.txt' has suffix '.txt'"):
        dataset_qa_env_from_file(path=str(tmp_path / "qa.txt"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dataset_qa_env_from_file(path=str(tmp_path / "nope.jsonl"))
    data = _write(tmp_path / "qa.jsonl", ROWS)
    with pytest.raises(ValueError, match="subset='main' applies to hf: datasets only"):
        load_records(str(data), subset="main")
    (tmp_path / "torn.json").write_text('[{"question": "1+1", "answer": ')
    with pytest.raises(ValueError, match=r"could not read .*torn.json"):
        load_records(str(tmp_path / "torn.json"))


def test_holdout_parts_are_disjoint_cover_everything_and_repeat() -> None:
    records = list(range(20))
    train = split_holdout(records, 0.25, seed=3)
    heldout = split_holdout(records, 0.25, seed=3, part="heldout")
    assert len(heldout) == 5 and sorted(train + heldout) == records
    assert train == sorted(train) and heldout == sorted(heldout)  # file order kept
    assert split_holdout(records, 0.25, seed=3, part="heldout") == heldout
    assert split_holdout(records, 0.25, seed=4, part="heldout") != heldout
    assert split_holdout(records, 5, seed=3, part="heldout") == heldout  # a count
    assert split_holdout(records, 0) == records
    for bad in (-1, 20, 0.001, True):
        with pytest.raises(ValueError, match="holdout"):
            split_holdout(records, bad)
    with pytest.raises(ValueError, match="part='test'"):
        split_holdout(records, 2, part="test")  # type: ignore[arg-type]


def test_env_parts_split_the_file(tmp_path) -> None:
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    data = str(_write(tmp_path / "qa.csv", rows))
    train = dataset_qa_env_from_file(path=data, holdout=3)
    heldout = dataset_qa_env_from_file(path=data, holdout=3, part="heldout")
    questions = {s["question"] for s in train.samples}
    assert len(heldout.samples) == 3 and len(train.samples) == 7
    assert questions.isdisjoint(s["question"] for s in heldout.samples)
    # CSV cells come back typed (an int answer); the numeric verifier reads them as text
    heldout.reset(seed=0)
    target = str(heldout.current_sample["answer"])
    assert heldout.step({"agent_0": target})["agent_0"].reward == 1.0


def _hub_cache(cache: Path, tmp_path: Path) -> None:
    """What ``load_dataset("toyorg/toyqa")`` leaves in ``HF_DATASETS_CACHE`` when it has
    downloaded the dataset once: Arrow files and dataset_info.json per config/version."""
    rows = {"train": ROWS[:2], "test": ROWS[2:]}
    files = {split: str(_write(tmp_path / f"{split}.jsonl", r)) for split, r in rows.items()}
    builder = datasets.load_dataset_builder(
        "json", data_files=files, cache_dir=str(tmp_path / "build")
    )
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    target = cache / "toyorg___toyqa" / "default" / "0.0.0" / "0123abcd"
    target.mkdir(parents=True)
    for arrow in built.glob("*.arrow"):
        shutil.copy(arrow, target / arrow.name.replace("json-", "toyqa-"))
    info = json.loads((built / "dataset_info.json").read_text())
    info.update(config_name="default", dataset_name="toyqa")
    for split in info["splits"].values():
        split["dataset_name"] = "toyqa"
    (target / "dataset_info.json").write_text(json.dumps(info))


def test_hf_datasets_load_offline_from_the_local_cache(tmp_path) -> None:
    cache = tmp_path / "hf-datasets"
    _hub_cache(cache, tmp_path)
    script = textwrap.dedent(
        """
        import sys
        from ludic.run.parts import dataset_qa_env_from_file
        kw = dict(verifier="math", question_key="problem", answer_key="solution")
        train = dataset_qa_env_from_file(path="hf:toyorg/toyqa", **kw)
        test = dataset_qa_env_from_file(path="hf:toyorg/toyqa:test", **kw)
        print(len(train.samples), len(test.samples), test.samples[0]["solution"])
        try:
            dataset_qa_env_from_file(path="hf:toyorg/not-cached", **kw)
        except ValueError as e:
            print("ERROR", e)
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "2 1 (0, 1]"
    assert lines[1].startswith("ERROR env.kwargs.path: could not read 'hf:toyorg/not-cached'")
    assert "HF_HUB_OFFLINE=1" in lines[1]


def test_a_run_trains_on_one_part_and_evaluates_on_the_held_out_one(tmp_path, capsys) -> None:
    """From config: the train env holds only the train part, the eval env only the held-out
    part, and the run trains; holding out without evaluating on the held-out part is a
    config error naming the field, reported before any run folder exists."""
    from ludic.cli import main
    from ludic.run.builders import build_env
    from ludic.run.loading import load_config

    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(12)]
    data = _write(tmp_path / "qa.jsonl", rows)
    config = tmp_path / "run.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            name: heldout
            output_dir: {tmp_path / "runs"}
            env: {{kind: dataset_qa, kwargs: {{path: {data}, holdout: 4}}}}
            sampling: {{max_tokens: 2}}
            warm_start: {{steps: 0}}
            algorithm: {{group_size: 2}}
            trainer: {{steps: 2, prompts_per_step: 2}}
            eval: {{num_problems: 4}}
            """
        )
    )
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "env.eval_kwargs.part" in err and "heldout" in err
    assert not (tmp_path / "runs").exists()

    loaded = load_config(config, ["env.eval_kwargs.part=heldout"])
    heldout = split_holdout(rows, 4, part="heldout")
    assert list(build_env(loaded, loaded.env.eval_kwargs).samples) == heldout
    assert list(build_env(loaded).samples) == split_holdout(rows, 4)
    assert main(["train", str(config), "env.eval_kwargs.part=heldout"]) == 0
