"""The package's shape, read from its imports: every `import` and `from ... import` of `async_rl`
(at module level, inside functions and under `if TYPE_CHECKING:` alike) makes an edge between two
modules. The modules' layers come from the table in docs/architecture.md ('Layers'), so the page a
reader opens and the rule this test keeps are one text. Fails on: a cycle between modules, an import
from a lower layer into a higher one, a module no layer names, a row naming nothing, and a module of
the rollout side longer than ROLLOUT_MAX_LINES."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "async_rl"
DOC = REPO / "docs" / "architecture.md"
ROLLOUT_MAX_LINES = 400  # a module a reader takes in at once


class Layer:
    def __init__(self, rank: int, name: str, prefixes: list[str], rollout: bool) -> None:
        self.rank, self.name, self.prefixes, self.rollout = rank, name, prefixes, rollout


def read_layers(text: str) -> list[Layer]:
    """The rows of the table under '## Layers': | rank | name | `module`, ... | rollout side? |."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        layers.append(Layer(int(cells[0]), cells[1], re.findall(r"`([\w.]+)`", cells[2]), cells[3] == "yes"))
    return layers


def module_files() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The async_rl modules `name` imports. `from pkg import sub` names the module `pkg.sub`;
    `from mod import thing` names `mod`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in mods:  # `import async_rl.x.y` where y is a name in x
                target = target.rpartition(".")[0]
            if target and target.startswith("async_rl") and target != name:
                found.add(target)
    return found


def layer_of(module: str, layers: list[Layer]) -> Layer | None:
    best: tuple[int, Layer] | None = None
    for layer in layers:
        for p in layer.prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), layer)
    return best[1] if best else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    return read_layers(DOC.read_text())


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = module_files()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def test_the_doc_names_the_layers(layers):
    ranks = [layer.rank for layer in layers]
    assert len(set(ranks)) >= 5 and ranks == sorted(ranks)  # rows of one rank are one layer


def test_every_module_has_a_layer_and_every_row_names_a_module(layers, graph):
    homeless = [m for m in sorted(graph) if layer_of(m, layers) is None]
    assert not homeless, "no layer in docs/architecture.md names: " + ", ".join(homeless)
    named = {p for layer in layers for p in layer.prefixes}
    stale = sorted(p for p in named if not any(m == p or m.startswith(p + ".") for m in graph))
    assert not stale, "docs/architecture.md's layers name modules that do not exist: " + ", ".join(stale)


def test_no_import_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_runs_up_the_layers(layers, graph):
    upward = []
    for module, targets in sorted(graph.items()):
        own = layer_of(module, layers)
        for target in sorted(targets):
            other = layer_of(target, layers)
            if own is not None and other is not None and other.rank > own.rank:
                upward.append(f"{module} ({own.name}) -> {target} ({other.name})")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_rollout_side_modules_stay_small(layers, graph):
    long = []
    for module, path in module_files().items():
        layer = layer_of(module, layers)
        if layer is not None and layer.rollout:
            lines = len(path.read_text().splitlines())
            if lines > ROLLOUT_MAX_LINES:
                long.append(f"{module}: {lines} lines")
    assert not long, f"rollout-side modules over {ROLLOUT_MAX_LINES} lines: " + ", ".join(long)


def test_the_checks_catch_what_they_are_for():
    """The reader and the cycle finder on a made-up graph (a check that cannot fail keeps nothing)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    doc = "x\n## Layers\n\n| 1 | base | `p.a`, `p.b` | no |\n| 2 | top | `p.c` | yes |\n\n## Next\n| 3 | no | `q` | no |\n"
    got = read_layers(doc)
    assert [(layer.rank, layer.name, layer.prefixes, layer.rollout) for layer in got] == [
        (1, "base", ["p.a", "p.b"], False),
        (2, "top", ["p.c"], True),
    ]
    assert layer_of("p.a.sub", got).name == "base" and layer_of("p.c", got).name == "top" and layer_of("p.d", got) is None
