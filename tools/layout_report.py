"""The layout figures of issue 22, measured from a checkout's own files:

    python tools/layout_report.py [ROOT]          # ROOT: a checkout (default: this one)
    python tools/layout_report.py ROOT --walk     # also trace `ludic train` to the Trainer

* rooms: files and lines per package folder (the largest folders);
* import cycles: strongly connected components of the module import graph, counting
  imports inside functions and lazily exported names (tests/test_architecture.py);
* imports inside functions, per package;
* modules over 400 lines;
* README.md length;
* --walk: the config walk -- a real ``ludic train`` (the demo config, no warm start, one
  RL step, in-process backend) traced with ``sys.setprofile`` from ``ludic.cli.main`` until
  ``Trainer.__init__`` is entered: every call from one ludic file into a function of
  another that is handed the run config (or one of its sections) is a stop (each distinct
  caller -> callee once); a stop into a file the walk had already left is a return.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _architecture(root: Path):
    spec = importlib.util.spec_from_file_location("arch", HERE / "tests" / "test_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SRC = root / "src"
    return module


def report(root: Path) -> None:
    src = root / "src" / "ludic"
    files = sorted(src.rglob("*.py"))
    lines = {f: len(f.read_text().splitlines()) for f in files}
    rooms = Counter()
    room_lines = Counter()
    for f in files:
        room = str(f.parent.relative_to(src.parent))
        rooms[room] += 1
        room_lines[room] += lines[f]
    print(f"src/ludic: {len(files)} files, {sum(lines.values())} lines")
    print("largest rooms (files, lines):")
    for room, n in rooms.most_common(6):
        print(f"  {room}: {n} files, {room_lines[room]} lines")
    arch = _architecture(root)
    graph = arch.import_graph()
    cycles = arch.import_cycles(graph)
    print(f"import cycles: {len(cycles)}")
    for c in cycles:
        print("  " + " <-> ".join(c))
    inner = Counter()
    for f in files:
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ludic"):
                        inner[str(f.parent.relative_to(src.parent))] += 1
    print(f"ludic imports inside functions: {sum(inner.values())} ({dict(inner.most_common(4))})")
    big = sorted(((n, f) for f, n in lines.items() if n > 400), reverse=True)
    print(f"modules over 400 lines: {len(big)}")
    for n, f in big:
        print(f"  {n:5d} {f.relative_to(root)}")
    print(f"README.md: {len((root / 'README.md').read_text().splitlines())} lines")


WALK = r"""
import os, sys
from pathlib import Path
SRC = os.path.realpath(sys.argv[1])
stops, returns, seen_files, last, edges = [], 0, [], None, set()
class Done(Exception):
    pass
def profile(frame, event, arg):
    global last, returns
    if event != "call":
        return
    path = os.path.realpath(frame.f_code.co_filename)
    if not path.startswith(SRC):
        return
    caller = frame.f_back
    cpath = os.path.realpath(caller.f_code.co_filename) if caller else None
    if cpath is None or not cpath.startswith(SRC) or cpath == path:
        return
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    carries_config = any(
        type(frame.f_locals.get(n)).__module__.startswith("ludic.run.config") for n in names
    )
    if not carries_config:  # follow the run config (or one of its sections) only
        return
    if frame.f_code.co_name == "__init__" and path.endswith("training/trainer.py"):
        stops.append(path)
        raise Done
    edge = (cpath, caller.f_code.co_name, path, code.co_name)
    if edge in edges:  # the same call again (an env built per episode): one stop
        return
    edges.add(edge)
    if path in seen_files and path != seen_files[-1]:
        returns += 1
    stops.append(path)
    seen_files.append(path)
from ludic.cli import main
sys.setprofile(profile)
try:
    main(sys.argv[2:])
except Done:
    pass
finally:
    sys.setprofile(None)
print(f"config walk: {len(stops)} stops in {len(set(stops))} files, {returns} returns")
if os.environ.get("WALK_PATH"):
    print(" > ".join(Path(s).relative_to(SRC).as_posix().removesuffix(".py") for s in stops))
"""


def walk(root: Path) -> None:
    demo = root / "src" / "ludic" / "configs" / "arithmetic_demo.yaml"
    with tempfile.TemporaryDirectory() as out:
        argv = ["train", str(demo), "warm_start.steps=0", "trainer.steps=1",
                f"output_dir={out}", "eval.every=0"]
        env = {**os.environ, "PYTHONPATH": str(root / "src")}
        done = subprocess.run(
            [sys.executable, "-c", WALK, str(root / "src" / "ludic"), *argv],
            env=env, capture_output=True, text=True, check=False, cwd=out,
        )
        line = [x for x in done.stdout.splitlines() if x.startswith("config walk")]
        if os.environ.get("WALK_PATH"):
            print(done.stdout.splitlines()[-1])
        print(line[-1] if line else f"walk failed: {done.stderr[-2000:]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root", nargs="?", default=str(HERE))
    parser.add_argument("--walk", action="store_true")
    args = parser.parse_args()
    report(Path(args.root).resolve())
    if args.walk:
        walk(Path(args.root).resolve())
