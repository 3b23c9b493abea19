"""The product's shape, checked so that a regrowth fails a test instead of a review: no class
over 500 lines, no function over 60, no two product classes of one name (nor one named as the
plural of another beside it), and a daemon that starts drafter training without importing torch
(its trainers import it, in their process)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("tltd", "workers", "clients")
MAX_CLASS_LINES = 500
MAX_FUNCTION_LINES = 60

# Two classes of one name, each pair with its reason (name -> why it is still allowed).
SAME_NAME = {
    "EngineSpec": (
        "the engine's own spec (workers/engine/engine_spec.py) beside the contract's wire "
        "spec; the engine's room"
    ),
    "_Group": "private to their modules (services/weight_groups.py, engine/ngram.py)",
    "_SpecTotals": "private to their modules (metrics.py, engine/stats.py)",
}


def _files() -> list[Path]:
    return [
        p
        for pkg in PRODUCT
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


def _definitions() -> list[tuple[Path, ast.AST]]:
    out = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((path, node))
    return out


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def _too_long(defs, kind: type | tuple[type, ...], limit: int) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_lines(node)} lines)"
        for path, node in defs
        if isinstance(node, kind) and _lines(node) > limit
    )


def test_no_class_over_500_lines():
    bad = _too_long(_definitions(), ast.ClassDef, MAX_CLASS_LINES)
    assert not bad, bad


def test_no_function_over_60_lines():
    bad = _too_long(_definitions(), (ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not bad, bad


def test_no_two_product_classes_share_a_name():
    where: dict[str, list[str]] = defaultdict(list)
    for path, node in _definitions():
        if isinstance(node, ast.ClassDef):
            where[node.name].append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    bad = {name: paths for name, paths in shared.items() if name not in SAME_NAME}
    assert not bad, bad
    stale = set(SAME_NAME) - set(shared)
    assert not stale, f"allowed but gone (drop them from the list): {stale}"


# A class named as another's plural in its own package reads as the holder of those objects;
# each pair allowed with its reason (singular name -> why).
PLURAL_ALLOWED = {
    "AbortRequest": (
        "request bodies of SGLang's /abort_request (http/sglang_control.py) and vLLM's "
        "/abort_requests (http/vllm_api.py), named after their endpoints"
    ),
}


def _plural_pairs(classes: list[tuple[Path, str]]) -> set[str]:
    """Singular names with a class of the same name plus "s" in the same folder."""
    by_folder: dict[Path, set[str]] = defaultdict(set)
    for path, name in classes:
        by_folder[path.parent].add(name)
    return {n for names in by_folder.values() for n in names if n + "s" in names}


def test_no_class_is_named_as_the_plural_of_another_in_its_package():
    classes = [(p, n.name) for p, n in _definitions() if isinstance(n, ast.ClassDef)]
    pairs = _plural_pairs(classes)
    bad = sorted(pairs - set(PLURAL_ALLOWED))
    assert not bad, f"rename one of each pair, or allow it with a reason: {bad}"
    stale = set(PLURAL_ALLOWED) - pairs
    assert not stale, f"allowed but gone (drop them from the list): {stale}"
    # The check sees a pair (it is not blind).
    assert _plural_pairs([(ROOT / "a/x.py", "Run"), (ROOT / "a/y.py", "Runs")]) == {"Run"}
    assert not _plural_pairs([(ROOT / "a/x.py", "Run"), (ROOT / "b/y.py", "Runs")])


def test_the_size_checks_see_a_long_class_and_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    tree = ast.parse(f"class Big:\n{body}\n\ndef f():\n" + "    pass\n" * MAX_FUNCTION_LINES)
    kinds = ast.ClassDef | ast.FunctionDef
    defs = [(ROOT / "x.py", n) for n in ast.walk(tree) if isinstance(n, kinds)]
    assert _too_long(defs, ast.ClassDef, MAX_CLASS_LINES) == ["x.py:1 Big (501 lines)"]
    assert len(_too_long(defs, ast.FunctionDef, MAX_FUNCTION_LINES)) == 1


_DAEMON_WITHOUT_TORCH = """
import asyncio, sys, tempfile
from pathlib import Path
import tltd.daemon, tltd.periodic, tltd.cli
from tltd.contract.drafter_messages import TrainerSpec
from tltd.drafter_training import DrafterTraining
from tltd.drafter_training.process import TrainerProcess
from tltd.settings import load_settings
from tltd.store import Store
from tltd.store.migrate import upgrade

tmp = Path(tempfile.mkdtemp())
url = f"sqlite:///{tmp / 'db.sqlite'}"
upgrade(url)
store = Store(url)
settings = load_settings(None, env={}, overrides={"port": 0, "data_dir": str(tmp / "data")})

async def main():
    training = DrafterTraining(store, settings)
    await training.close()

asyncio.run(main())
# The handle of a trainer process names its entry point: still no torch in the daemon.
TrainerProcess(TrainerSpec(model_path=str(tmp), checkpoint_dir=str(tmp / "ckpt")))
store.close()
print("TORCH", "torch" in sys.modules)
"""


def test_the_daemon_with_training_on_does_not_import_torch():
    """The daemon's modules, a `DrafterTraining` started and closed, and a trainer process's
    handle (not spawned): torch is not imported (a trainer imports it in its own process)."""
    out = subprocess.run(
        [sys.executable, "-c", _DAEMON_WITHOUT_TORCH],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "TORCH False" in out.stdout, out.stdout
