"""Size guards: a module stays under 500 lines, a function under 60, the README under 150,
and an import inside a function brings in an optional or heavy dependency only.

What is over a cap today is listed below with its size as a ceiling (issue 41's debt):
a listed entry may shrink but not grow, and must be removed once it fits the cap, so the
lists only get shorter. ``python tests/test_size_guards.py`` prints today's figures.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "ludic"

SRC_LINES = 39_698
"""``src/ludic`` in lines, at most (issue 41's goal: 35,000)."""
MODULE_LINES = 500
FUNCTION_LINES = 60
README_LINES = 150

OPTIONAL_OR_HEAVY = frozenset(
    # heavy: torch and what builds on it (a CLI that only parses must not pay for them)
    ["torch", "transformers", "peft", "safetensors", "huggingface_hub", "vllm", "ray"]
    + ["matplotlib"]
    # optional extras (pyproject.toml): absent unless their extra is installed
    + ["redis", "wandb", "tensorboard", "datasets", "reasoning_gym", "textarena", "verifiers"]
    + ["openenv", "openai", "uvicorn", "uvloop", "psutil", "math_verify", "trl"]
)
"""Top-level packages an import inside a function may name."""

MODULES_OVER: dict[str, int] = {
    "inference/vllm/control.py": 597,
    "inference/vllm/pool.py": 563,
    "inference/vllm/process.py": 510,
    "pipeline/batch_source.py": 505,
    "pipeline/ray_launch.py": 605,
    "pipeline/redis_queue.py": 646,
    "run/config.py": 763,
    "types.py": 577,
}
FUNCTIONS_OVER: dict[str, int] = {}
LOCAL_IMPORTS: dict[str, int] = {
    "cli/commands.py": 14,
    "cli/output.py": 2,
    "distributed/reward_publisher.py": 1,
    "inference/router/app.py": 1,
    "inference/vllm/client.py": 1,
    "inference/vllm/control.py": 2,
    "inference/vllm/joins.py": 3,
    "inference/vllm/server.py": 1,
    "inference/vllm/weight_sync.py": 2,
    "inference/vllm/worker.py": 1,
    "pipeline/actor.py": 5,
    "pipeline/launch.py": 2,
    "pipeline/learner.py": 5,
    "pipeline/ray_launch.py": 2,
    "pipeline/ray_local.py": 1,
    "pipeline/ray_processes.py": 8,
    "pipeline/run_info.py": 2,
    "run/models.py": 2,
    "run/parts.py": 2,
    "run/registries.py": 2,
    "run/reward_job.py": 1,
    "run/reward_loop.py": 5,
    "run/reward_sleep.py": 3,
    "run/servers.py": 17,
    "run/trainer_ranks.py": 2,
}
"""Per module, imports inside functions of anything but :data:`OPTIONAL_OR_HEAVY`."""


def _modules() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(SRC)): ast.parse(path.read_text())
        for path in sorted(SRC.rglob("*.py"))
    }


def module_lines() -> dict[str, int]:
    return {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}


def function_lines() -> dict[str, int]:
    """``module:name`` -> lines of the longest function of that name in the module
    (methods and nested functions count on their own, and inside their parent)."""
    out: dict[str, int] = {}
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key, lines = f"{module}:{node.name}", node.end_lineno - node.lineno + 1
                out[key] = max(out.get(key, 0), lines)
    return out


def local_imports() -> dict[str, int]:
    """Module -> imports inside its functions of packages not in OPTIONAL_OR_HEAVY."""
    counts = {module: _inside_functions(tree, False) for module, tree in _modules().items()}
    return {module: n for module, n in counts.items() if n}


def _inside_functions(node: ast.AST, in_function: bool) -> int:
    """The light imports below ``node`` that sit inside a function (each counted once)."""
    if in_function and (found := _light_import(node)):
        return found
    in_function = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    return sum(_inside_functions(child, in_function) for child in ast.iter_child_nodes(node))


def _light_import(node: ast.AST) -> int:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = ["ludic" if node.level else node.module or ""]
    else:
        return 0
    return sum(name.split(".")[0] not in OPTIONAL_OR_HEAVY for name in names)


def _over(sizes: dict[str, int], cap: int, debt: dict[str, int], what: str) -> list[str]:
    problems = []
    for key, size in sorted(sizes.items()):
        ceiling = debt.get(key, cap)
        if size > ceiling:
            problems.append(f"{key}: {size} {what} (at most {ceiling})")
    for key in sorted(debt):
        if sizes.get(key, 0) <= cap:
            problems.append(f"{key}: fits the cap of {cap} now; remove it from the list")
    return problems


def test_src_ludic_does_not_grow() -> None:
    total = sum(module_lines().values())
    assert total <= SRC_LINES, f"src/ludic is {total} lines (at most {SRC_LINES})"


def test_no_module_passes_its_cap() -> None:
    problems = _over(module_lines(), MODULE_LINES, MODULES_OVER, "lines")
    assert not problems, "\n".join(problems)


def test_no_function_passes_its_cap() -> None:
    problems = _over(function_lines(), FUNCTION_LINES, FUNCTIONS_OVER, "lines")
    assert not problems, "\n".join(problems)


def test_imports_inside_functions_are_of_optional_or_heavy_packages() -> None:
    problems = _over(local_imports(), 0, LOCAL_IMPORTS, "light imports inside functions")
    assert not problems, "\n".join(problems)


def test_readme_is_a_landing_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md is {lines} lines (at most {README_LINES})"


def test_the_guards_see_a_long_function_and_a_light_local_import() -> None:
    tree = ast.parse("def f():\n    import json\n    import torch\n" + "    x = 1\n" * 70)
    (function,) = tree.body
    assert function.end_lineno - function.lineno + 1 == 73
    assert _inside_functions(tree, False) == 1
    assert (
        _inside_functions(
            ast.parse("import json\ndef g():\n    def h():\n        import os\n"), False
        )
        == 1
    )
    assert _over({"a": 73}, 60, {}, "lines") == ["a: 73 lines (at most 60)"]
    assert _over({"a": 50}, 60, {"a": 73}, "lines")[0].endswith("remove it from the list")


if __name__ == "__main__":  # python tests/test_size_guards.py [CHECKOUT]: today's figures
    import sys

    if len(sys.argv) > 1:
        ROOT = Path(sys.argv[1]).resolve()
        SRC = ROOT / "src" / "ludic"
    print("src/ludic:", sum(module_lines().values()), "lines;")
    print("README.md:", len((ROOT / "README.md").read_text().splitlines()), "lines")
    for name, sizes, cap in (
        ("modules", module_lines(), MODULE_LINES),
        ("functions", function_lines(), FUNCTION_LINES),
        ("light imports inside functions, per module", local_imports(), 0),
    ):
        over = {key: size for key, size in sorted(sizes.items()) if size > cap}
        print(f"{name} over {cap}: {len(over)} (sum {sum(over.values())})")
        for key, size in over.items():
            print(f"    {key!r}: {size},")
