"""Imports flow one way (issue 37), read from the source with ast (nothing is imported or run).

The graph counts every `import` of a moerun module, at the top of a file or inside a function; only the bodies
of `if TYPE_CHECKING:` are left out (they never run). Two rules:

- no circles: no module reaches itself through imports;
- no import goes up the design's layers (LAYERS, lowest first; ARCHITECTURE.md, "Data flows one way"): a module
  imports modules of its own layer and of lower ones. The few allowed exceptions are in ALLOWED, each with its
  reason; an exception the code no longer needs fails the test too, so the list only shrinks.

A module not covered by LAYERS fails the test: a new module gets its place in the table. The checker runs on a
planted graph and a planted source tree first (test_the_checker_*), so it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = "moerun"
PKG_DIR = Path(__file__).resolve().parents[1] / PKG

# The layers, lowest first. An entry names a module, or a package and everything under it; the longest entry
# that covers a module places it ("moerun" itself names only the package's __init__).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # errors, sizes, host memory, the device module and its stand-in, settings, the built-in model's name, progress,
    # hub references (moerun.hub imports huggingface_hub only when it resolves one)
    ("base", ("moerun", "moerun.errors", "moerun.sizes", "moerun.hostmem", "moerun.standin", "moerun.device",
              "moerun.config", "moerun.builtin", "moerun.progress", "moerun.hub")),
    ("quant", ("moerun.quant",)),  # QType, QTensor, the torch reference dequantizers
    ("kernels", ("moerun.kernels",)),  # the C extension's and Triton's kernels over QTensors
    ("formats", ("moerun.formats", "moerun.text")),  # what a model file holds: tensor records, metadata, vocabulary
    ("arch", ("moerun.arch",)),
    ("placement", ("moerun.placement",)),  # the pure part: inventory, bandwidth, cost model, planner
    ("weights", ("moerun.weights",)),
    ("experts", ("moerun.experts",)),
    ("model", ("moerun.model",)),
    ("engine", ("moerun.engine",)),
    # placement's measurements: the layer probe builds MoEModels and KV pools of a model's own layers and decodes
    # on them, the kernel probe multiplies experts; the planner and cost model only read the rates they give
    ("probes", ("moerun.placement.probes", "moerun.placement.layer_probe")),
    # what walks the chain for a configuration, and what measures or builds whole models
    ("runtime", ("moerun.runtime", "moerun.runtime_device", "moerun.loading", "moerun.distributed",
                 "moerun.expert_parallel", "moerun.bench", "moerun.bench_ranks", "moerun.gpu_counts",
                 "moerun.tools")),
    ("server/cli", ("moerun.server", "moerun.cli", "moerun.cli_bench", "moerun.cli_estimate", "moerun.cli_flags",
                    "moerun.cli_generate", "moerun.cli_serve", "moerun.__main__")),
]

# (importer, imported) -> why this upward import is allowed. The one list of exceptions.
ALLOWED: dict[tuple[str, str], str] = {
    ("moerun.config", "moerun.experts.policy"):
        "RuntimeConfig checks --cache-policy against the policies' names (POLICIES); policy.py imports nothing "
        "of moerun",
    ("moerun.placement.costmodel", "moerun.experts.trace"):
        "trace_hit_rates replays a routing trace through the experts' cache simulator (policies and counters "
        "only, no tensors) for `estimate --trace`",
    ("moerun.placement.planner", "moerun.model.layers"):
        "attention_workspace_bytes sizes a device's attention scratch from the attention's own block sizes "
        "(QUERY_BLOCK, SMALL_T), which live beside the code they size",
}


# ------------------------------------------------------------------------------------------ the graph


def module_files(pkg_dir: Path, pkg: str) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py under pkg_dir (a package's __init__ names the package)."""
    mods = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        parts = [p for p in f.relative_to(pkg_dir).with_suffix("").parts if p != "__init__"]
        mods[".".join([pkg, *parts])] = f
    return mods


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except inside `if TYPE_CHECKING:` (its else branch counts)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def build_graph(pkg_dir: Path, pkg: str = PKG) -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first such import}, for imports of the package's own
    modules. `import a.b.c` and `from a.b import c` go to the deepest module that exists (c when it is a module,
    else a.b's file); a module's imports of itself are dropped."""
    mods = module_files(pkg_dir, pkg)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {}
    for name, f in mods.items():
        out: dict[str, str] = {}
        is_pkg = f.name == "__init__.py"
        for node in _imports(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names if a.name == pkg or a.name.startswith(pkg + ".")]
            else:
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod != pkg and not mod.startswith(pkg + "."):
                    continue
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else resolve(mod) for a in node.names]
            where = f"{f.relative_to(pkg_dir.parent)}:{node.lineno}"
            for t in targets:
                if t is not None and t != name:
                    out.setdefault(t, where)
        graph[name] = out
    return graph


def find_cycles(graph: dict[str, dict[str, str]] | dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(rank, layer name) of the longest LAYERS entry covering `module`, or None."""
    best = None
    for rank, (layer, entries) in enumerate(layers):
        for e in entries:
            covers = module == e or (e != PKG and module.startswith(e + "."))
            if covers and (best is None or len(e) > best[0]):
                best = (len(e), rank, layer)
    return None if best is None else best[1:]


def upward_imports(graph, layers=LAYERS, allowed=ALLOWED) -> list[tuple[str, str, str]]:
    """(importer, imported, where) for each import of a higher layer's module not in `allowed`."""
    bad = []
    for a, targets in sorted(graph.items()):
        found = targets if isinstance(targets, dict) else dict.fromkeys(targets, "?")
        for b, where in sorted(found.items()):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb[0] > la[0] and (a, b) not in allowed:
                bad.append((a, b, where))
    return bad


def _cycle_lines(graph, cycles) -> str:
    lines = []
    for comp in cycles:
        lines.append("circle: " + " <-> ".join(comp))
        for a in comp:
            for b, where in sorted(graph[a].items()):
                if b in comp:
                    lines.append(f"    {a} -> {b}  ({where})")
    return "\n".join(lines)


def _upward_lines(bad) -> str:
    return "\n".join(f"{a} ({layer_of(a)[1]}) imports {b} ({layer_of(b)[1]}) at {where}" for a, b, where in bad)


# ------------------------------------------------------------------------------------------- the rules


@pytest.fixture(scope="module")
def graph():
    g = build_graph(PKG_DIR)
    assert len(g) > 100 and sum(len(v) for v in g.values()) > 300, "the walk found too little of moerun"
    return g


def test_no_import_circles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import circles (break them by moving the shared piece down):\n" + _cycle_lines(graph, cycles)


def test_every_module_has_a_layer(graph):
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert not missing, f"modules without a layer (give each its place in tests/test_imports.py's LAYERS): {missing}"


def test_imports_flow_down_the_layers(graph):
    bad = upward_imports(graph)
    order = " -> ".join(name for name, _ in LAYERS)
    assert not bad, f"imports that go up the layers ({order}):\n" + _upward_lines(bad)


def test_every_allowed_exception_is_still_needed(graph):
    def up(a: str, b: str) -> bool:
        la, lb = layer_of(a), layer_of(b)
        return la is not None and lb is not None and lb[0] > la[0]

    stale = [(a, b) for a, b in ALLOWED if b not in graph.get(a, {}) or not up(a, b)]
    assert not stale, f"ALLOWED lists imports that are gone or no longer go up (drop them): {stale}"


# ------------------------------------------------------------------------------- the checker, checked


def test_the_checker_finds_a_planted_circle_and_an_upward_import():
    layers = [("low", ("p.low",)), ("high", ("p.high",))]
    graph = {"p.low.a": {"p.low.b"}, "p.low.b": {"p.low.c"}, "p.low.c": {"p.low.a"},  # a circle of three
             "p.low.d": {"p.high.x"},  # up
             "p.high.x": {"p.low.d"}, "p.high.y": {"p.low.a"}}  # down; x <-> d is a circle too
    assert find_cycles(graph) == [["p.high.x", "p.low.d"], ["p.low.a", "p.low.b", "p.low.c"]]
    assert [(a, b) for a, b, _ in upward_imports(graph, layers, {})] == [("p.low.d", "p.high.x")]
    assert upward_imports(graph, layers, {("p.low.d", "p.high.x"): "planted"}) == []
    acyclic = {"p.low.a": {"p.low.b"}, "p.low.b": set(), "p.high.x": {"p.low.a", "p.low.b"}}
    assert find_cycles(acyclic) == [] and upward_imports(acyclic, layers, {}) == []


def test_the_checker_reads_imports_as_the_rule_says(tmp_path):
    """Function-level and relative imports count, TYPE_CHECKING's body does not (its else does); a
    `from package import module` goes to the module, a `from module import name` to the module."""
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low.py": "def f():\n    from pk.high import g\n",  # up, inside a function: a circle with high
        "high.py": "from . import low\nfrom pk.sub import leaf\n",
        "sub/__init__.py": "",
        "sub/leaf.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pk.high import g\n"
                        "else:\n    from ..low import f\nimport os\n"),
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = build_graph(pkg, "pk")
    assert {m: set(v) for m, v in graph.items()} == {
        "pk": set(), "pk.sub": set(), "pk.low": {"pk.high"}, "pk.high": {"pk.low", "pk.sub.leaf"},
        "pk.sub.leaf": {"pk.low"}}
    assert graph["pk.low"]["pk.high"] == "pk/low.py:2"
    assert find_cycles(graph) == [["pk.high", "pk.low", "pk.sub.leaf"]]  # high -> leaf -> low -> high
    layers = [("low", ("pk", "pk.low", "pk.sub")), ("high", ("pk.high",))]
    assert [(a, b) for a, b, _ in upward_imports(graph, layers, {})] == [("pk.low", "pk.high")]


def test_layer_of_takes_the_longest_entry():
    assert layer_of("moerun")[1] == "base"
    assert layer_of("moerun.placement.planner")[1] == "placement"
    assert layer_of("moerun.placement.layer_probe")[1] == "probes"
    assert layer_of("moerun.server.routes.info")[1] == "server/cli"
    assert layer_of("moerun.cli_generate")[1] == "server/cli"
    assert layer_of("moerunx") is None
