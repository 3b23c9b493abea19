"""The code's import graph: no circles, and `workers/` takes only the plain domain types from the
daemon (never its store).

Every import counts, also those under `if TYPE_CHECKING:` and inside functions: a circle hidden
by a lazy import is still two modules that cannot be understood one without the other.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# folder -> the name it installs as (setup.py)
PACKAGES = {"tltd": "tltd", "workers": "tltd_workers", "clients": "tltd_clients"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if not path.name.endswith("_pb2.py") and not path.name.endswith("_pb2_grpc.py"):
                found[_module_name(path)] = path
    return found


def _load_time(nodes: list[ast.stmt]):
    """The statements Python runs when it imports a module: not function bodies, not
    `if TYPE_CHECKING:` blocks."""
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _load_time(node.orelse)
            continue
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _load_time([child])
            elif isinstance(child, ast.ExceptHandler):
                yield from _load_time(child.body)


def _imports(name: str, path: Path, known: set[str], *, load_time: bool = False) -> set[str]:
    """The project modules `name` imports (a `from pkg import mod` names the module): every
    import, or with `load_time` those that run when the module is imported."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = _load_time(tree.body) if load_time else ast.walk(tree)
    is_pkg = path.name == "__init__.py"
    return {t for node in nodes for t in _targets(node, name, is_pkg, known)}


def _targets(node: ast.AST, name: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The project modules one statement imports (none when it is not an import)."""
    targets: list[str] = []
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if is_pkg else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        # `from pkg import mod` names the module; `from mod import name` the module.
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out: set[str] = set()
    for t in targets:
        # The deepest project module the import names (a class name is not a module).
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name:
            out.add(t)
    return out


@functools.cache  # read once per test session: the tests only read the graph
def _graph(*, load_time: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known, load_time=load_time) for n, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(importer, wrong, *, load_time: bool = False) -> list[str]:
    """'module imports target' for every `importer` module importing a `wrong` target."""
    return sorted(
        f"{m} imports {t}"
        for m, targets in _graph(load_time=load_time).items()
        if importer(m)
        for t in targets
        if wrong(t)
    )


def _workers_importing(wrong) -> list[str]:
    """'module imports target' for every module under workers/ importing a `wrong` target."""
    return _violations(lambda m: m.split(".")[0] == "tltd_workers", wrong)


def test_workers_do_not_import_the_daemon_store():
    bad = _workers_importing(lambda t: t == "tltd.store" or t.startswith("tltd.store."))
    assert not bad, bad


def test_workers_take_only_the_domain_from_the_daemon():
    """The daemon and its worker processes share `tltd.domain` (plain dataclasses) and the
    contract floor (`tltd.contract`: their messages, the broadcast group, checkpoint shapes);
    nothing else of `tltd` runs in a worker."""
    bad = _workers_importing(
        lambda t: (
            t.split(".")[0] == "tltd" and t != "tltd.domain" and not t.startswith("tltd.contract")
        )
    )
    assert not bad, bad


# ---- the contract floor: daemon and workers meet on it, neither imports the other ----------

# The functions of the daemon that may import worker code: those that name what a worker process
# runs (its entry point), called where the process is started. Everything else of the daemon
# meets the workers on the contract floor.
SPAWNERS = {
    "tltd.worker_code": "names the entry points of the rollout workers and drafter trainers",
}
# Exceptions, each with its reason: (module, function) -> why.
WORKER_CODE_ALLOWED = {
    ("tltd.services.drafters", "DrafterService.export"): (
        "not a process: converts a drafter for SGLang with the drafter's own code (torch), on "
        "call; the services' room"
    ),
}


def _worker_imports_by_function() -> list[tuple[str, str, str]]:
    """(module, enclosing function's qualified name or "<module>", target) for every import of
    `tltd_workers` in `tltd/`."""
    known = set(_modules())
    out = []
    for name, path in _modules().items():
        if _in(name, "tltd"):
            tree = ast.parse(path.read_text(), str(path))
            for scope, node in _scoped(tree, []):
                for t in _targets(node, name, path.name == "__init__.py", known):
                    if _in(t, "tltd_workers"):
                        out.append((name, ".".join(scope) or "<module>", t))
    return sorted(out)


def _scoped(node: ast.AST, scope: list[str]):
    """(enclosing class/function names, node) for every node under `node`."""
    for child in ast.iter_child_nodes(node):
        inner = scope
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            inner = [*scope, child.name]
        yield inner, child
        yield from _scoped(child, inner)


def test_the_daemon_imports_worker_code_only_in_the_functions_that_start_processes():
    found = _worker_imports_by_function()
    bad = [
        f"{m}.{fn} imports {t}"
        for m, fn, t in found
        if m not in SPAWNERS and (m, fn) not in WORKER_CODE_ALLOWED
    ]
    assert not bad, bad
    at_load = [f"{m} imports {t}" for m, fn, t in found if fn == "<module>"]
    assert not at_load, at_load
    # The check sees the imports it allows (it is not blind).
    assert {(m, fn) for m, fn, _ in found} >= {
        ("tltd.worker_code", "rollout_entry"),
        ("tltd.worker_code", "trainer_entry"),
    }
    stale = {k for k in WORKER_CODE_ALLOWED if k not in {(m, fn) for m, fn, _ in found}}
    assert not stale, f"allowed but gone (drop them from the list): {stale}"


# ---- the daemon's layers: every import points down -------------------------------------------

# `tltd/`, top to bottom. A module may import its own unit (a package of tltd, or a top-level
# module) and the units of lower layers; never a unit of its own layer or of a layer above.
LAYERS: list[tuple[str, ...]] = [
    ("tltd.__main__",),  # `python -m tltd`
    ("tltd.cli",),  # the command line
    ("tltd.daemon",),  # builds and runs everything below, top to bottom
    ("tltd.periodic", "tltd.http"),  # periodic jobs; the HTTP door (over the gRPC converters)
    ("tltd.api",),  # the gRPC door: servicers, converters, interceptors
    ("tltd.services",),  # use cases
    ("tltd.staging",),  # (see ARROWS_UP)
    ("tltd.drafter_training",),  # the supervisor's training hook
    ("tltd.supervisor",),  # worker processes, live requests, leases
    # Policy, persistence, hardware, metrics, and the names of the workers' entry points.
    (
        "tltd.scheduler",
        "tltd.store",
        "tltd.devices",
        "tltd.memory_cgroup",
        "tltd.metrics",
        "tltd.worker_code",
    ),  # fmt: skip
    ("tltd.settings",),  # config (checks the simulated engine's with the contract's parser)
    # The floor shared with workers; logging; the reapers' stall clock.
    ("tltd.contract", "tltd.logs", "tltd.stall"),
    ("tltd.domain", "tltd.errors", "tltd.v1", "tltd"),  # plain types, errors, stubs, version
]
# Arrows that point up or sideways today, each with its reason (unit -> unit).
ARROWS_UP = {
    ("tltd.staging", "tltd.services"): "staging moves under services (the services' room)",
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _layer_of() -> dict[str, int]:
    return {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _arrows_up(graph: dict[str, set[str]]) -> list[str]:
    layer = _layer_of()
    bad = []
    for m, targets in graph.items():
        if not _in(m, "tltd"):
            continue
        for t in targets:
            a, b = _unit(m), _unit(t)
            if not _in(t, "tltd") or a == b or (a, b) in ARROWS_UP:
                continue
            if layer[b] <= layer[a]:
                bad.append(f"{m} imports {t} ({a} is not above {b})")
    return sorted(bad)


def test_every_daemon_unit_has_a_layer():
    units = {_unit(m) for m in _graph() if _in(m, "tltd")}
    assert units == set(_layer_of()), units ^ set(_layer_of())


def test_no_arrow_points_up_in_the_daemon():
    bad = _arrows_up(_graph())
    assert not bad, bad
    stale = {k for k in ARROWS_UP if not _arrows_up_raw(k)}
    assert not stale, f"allowed but gone (drop them from the list): {stale}"


def _arrows_up_raw(arrow: tuple[str, str]) -> bool:
    return any(
        _unit(m) == arrow[0] and any(_unit(t) == arrow[1] for t in ts) for m, ts in _graph().items()
    )


def test_the_layer_check_sees_an_arrow_up():
    graph = {"tltd.store.x": {"tltd.supervisor.y"}, "tltd.supervisor.y": {"tltd.store.x"}}
    assert _arrows_up(graph) == [
        "tltd.store.x imports tltd.supervisor.y (tltd.store is not above tltd.supervisor)"
    ]
    # Sideways (two units of one layer) is an arrow up too.
    assert _arrows_up({"tltd.store.x": {"tltd.scheduler"}})


def test_the_contract_floor_depends_on_the_domain_only():
    assert not _graph()["tltd.domain"] - {"tltd"}, "tltd.domain imports the project"
    bad = _violations(
        lambda m: _in(m, "tltd.contract"),
        lambda t: not (_in(t, "tltd.contract") or t in ("tltd", "tltd.domain")),
    )
    assert not bad, bad


def test_the_daemon_imports_no_worker_code_at_load_time():
    bad = _violations(lambda m: _in(m, "tltd"), lambda t: _in(t, "tltd_workers"), load_time=True)
    assert not bad, bad


def test_the_engine_does_not_import_the_messages():
    """The engine is driven by the rollout worker; the daemon's messages stop at the worker."""
    messages = ("tltd.contract.rollout_messages", "tltd.contract.drafter_messages")
    bad = _violations(lambda m: _in(m, "tltd_workers.engine"), lambda t: t in messages)
    assert not bad, bad


def test_the_load_time_reading_skips_functions_and_type_checking():
    tree = ast.parse(
        "import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "def f():\n    import d\nclass K:\n    import e\n"
        "try:\n    import g\nexcept ImportError:\n    import h\n"
    )
    names = [n.names[0].name for n in _load_time(tree.body) if isinstance(n, ast.Import)]
    assert names == ["a", "c", "e", "g", "h"]


# ---- the client: the stubs, the domain and the wire converter, nothing of the daemon --------

# What `tltd_clients` may import of the project: the generated stubs, the plain domain, the
# typed errors the converter raises, the one proto <-> domain converter, and (inside the
# broadcast path only) how a policy broadcast's group is joined.
CLIENT_MAY_IMPORT = ("tltd", "tltd.v1", "tltd.domain", "tltd.errors", "tltd.api.convert")
CLIENT_MAY_IMPORT_LAZILY = ("tltd.contract.broadcast",)
# Installed with the daemon, absent where only the `client` extra is.
DAEMON_ONLY = (
    "sqlalchemy",
    "alembic",
    "apscheduler",
    "torch",
    "starlette",
    "uvicorn",
    "pydantic",
    "prometheus_client",
    "pynvml",
    "tltd_workers",
)


def _allowed_for_client(target: str, allowed: tuple[str, ...]) -> bool:
    return target.startswith(("tltd_clients", "tltd.v1.")) or target in allowed


def test_the_client_imports_only_the_stubs_the_domain_and_the_converter():
    graph = _graph()
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m.split(".")[0] == "tltd_clients"
        for t in targets
        if not _allowed_for_client(t, CLIENT_MAY_IMPORT + CLIENT_MAY_IMPORT_LAZILY)
    )
    assert not bad, bad
    # ... and what those import stays inside the same set (the converter takes no service).
    for module in ("tltd.api.convert", "tltd.domain", "tltd.errors", "tltd.contract.broadcast"):
        wrong = sorted(t for t in graph[module] if not _allowed_for_client(t, CLIENT_MAY_IMPORT))
        assert not wrong, f"{module} imports {wrong}"


_CLIENT_ALONE = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Absent())
import tltd_clients, tltd_clients.tltctl
from tltd_clients.rollout import _sample_from_pb
from tltd.v1 import rollout_pb2
s = _sample_from_pb(rollout_pb2.Sample(token_ids=[5, 2], finish_reason=1))
assert s.token_ids == [5, 2] and s.finish_reason == "stop", s
tltd_clients.RolloutClient("127.0.0.1:1").close()
loaded = sorted(m for m in sys.modules if m.startswith(("tltd.services", "tltd.store")))
print("LOADED", loaded)
"""


def test_the_client_runs_without_the_daemons_dependencies():
    """`import tltd_clients` (and tltctl) in a process where the daemon's dependencies cannot
    be imported: it loads, converts a sample and opens a client, and no service or store
    module of the daemon is loaded."""
    import subprocess
    import sys

    code = _CLIENT_ALONE.format(absent=set(DAEMON_ONLY))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout


def test_the_base_install_is_the_client_and_the_daemon_has_its_extra():
    """`pip install tltd` brings what the client imports and none of the daemon's packages;
    `tltd[daemon]` brings those."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dists = {"sqlalchemy", "alembic", "apscheduler", "torch", "starlette", "uvicorn", "pydantic",
             "prometheus-client", "nvidia-ml-py", "grpcio-reflection"}  # fmt: skip
    base = {Requirement(r).name.lower() for r in project["dependencies"]}
    assert not base & dists, base & dists
    daemon = {Requirement(r).name.lower() for r in project["optional-dependencies"]["daemon"]}
    assert dists - {"torch"} <= daemon
