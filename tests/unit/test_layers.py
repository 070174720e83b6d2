"""Layers that run one way: every import inside ``percache_core`` goes to its own part or
to a part of a lower layer, and the adapters import the public package only (``make lint``
runs this file).

The layers, lowest first (parts in one layer do not import each other):

1. ``errors``, ``types``, ``eviction``: names every part shares;
2. ``storage``, ``inputs``, ``usage``, ``models``, ``document_files``: the record store,
   input checks, usage counts, finding a model file, documents read from files;
3. ``kv``: what an engine is (the protocols), chunk states, their tree, store, budget and
   cut rule, stop strings: nothing of one engine;
4. ``config``: the settings (they name the engine's sampling and stop strings);
5. ``knowledge``, ``qa``: the documents with retrieval; the QA bank and prompt answers;
5b. ``policies``: how stored answers and chunk states may be reused, chosen once per
   configuration (the only place a mode is compared);
6. ``serving``, ``shared``: what every engine's runner shares (the runner base, prompt
   layouts, streaming, request shapes, what an engine kind is); the Redis tier behind the
   local ones;
6b. ``engines``: one folder per engine (its engine, runner and self-checks) and the registry;
   the folders do not import each other;
6c. ``answering``: answering a request on whichever engine (the runtime, the parts a cache
   is made of, the request path);
7. ``prediction``: idle work (the demand estimate, the predictor, the scheduler, the worker);
8. ``callers``, then ``pipeline`` (the ``PerCache`` facade), then ``endpoint`` (``percache
   serve``: the OpenAI-compatible endpoint over it), then ``demo`` (``percache demo``),
   then ``cli``, ``inspection`` (the parts behind a facade, for tests and benchmarks) and
   the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "percache_core"

LAYERS: list[set[str]] = [
    {"errors", "types", "eviction", "memo"},
    {"storage", "inputs", "usage", "models", "document_files"},
    {"kv"},
    {"config"},
    {"knowledge", "qa"},
    {"policies"},
    {"serving", "shared"},
    {"engines"},
    {"answering"},
    {"prediction"},
    {"callers"},
    {"pipeline"},
    {"endpoint"},
    {"demo"},
    {"cli", "inspection", "__init__", "__main__"},
]
LAYER_OF = {part: index for index, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """The part of ``percache_core`` a module belongs to (its first name below the package)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def imports(path: Path) -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every ``percache_core`` import in *path*."""
    names = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = names[-1] == "__init__"
    module = ".".join(names[:-1] if is_package else names)
    package = module if is_package else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] if node.module or not node.level else [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found += [(module, t, node.lineno) for t in targets if t.split(".")[0] == "percache_core"]
    return found


def upward_imports() -> list[str]:
    """Every import that goes to a higher layer or sideways to another part of the same layer."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, target, line in imports(path):
            source, destination = part_of(module), part_of(target)
            if source == destination:
                continue
            if source not in LAYER_OF or destination not in LAYER_OF:
                wrong.append(f"{path.name}:{line} {module} -> {target}: a part with no layer (add it to LAYERS)")
            elif LAYER_OF[destination] >= LAYER_OF[source]:
                wrong.append(f"{path.name}:{line} {module} -> {target} runs up ({source} is below {destination})")
    return wrong


def test_imports_run_down_the_layers():
    assert upward_imports() == []


def adapter_inner_imports() -> list[str]:
    """Imports of ``percache_core.<inner module>`` by the adapters (they use the public
    package only)."""
    wrong = []
    for adapter in ("percache_llamaindex", "percache_langchain"):
        folder = PACKAGE.parent / adapter
        for path in sorted(p for p in folder.rglob("*.py") if "build" not in p.relative_to(folder).parts):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                wrong += [f"{path.relative_to(folder)}:{node.lineno} imports {n}" for n in names if n.startswith("percache_core.")]
    return wrong


def test_adapters_use_the_public_package_only():
    assert adapter_inner_imports() == []


def import_circles() -> list[list[str]]:
    """Modules that import each other, directly or around a circle, counting imports inside
    functions (one list per circle, found as strongly connected components)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, target, _ in imports(path):
            graph.setdefault(module, set())
            graph.setdefault(target, set())
            if target != module:
                graph[module].add(target)
    # a name imported from a package may be one of its modules: "pkg.name" is the edge then
    graph = {m: {t for t in targets if t in graph} for m, targets in graph.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return circles


def test_no_module_imports_itself_around_a_circle():
    assert import_circles() == []


# outside engines/, only the public names (the package) and percache serve (a front for a
# llama-server, which it starts, relays to and is typed by) import an engine's module
ENGINE_IMPORTERS = {"__init__", "endpoint"}


def engine_of(module: str) -> str | None:
    """The engine folder *module* belongs to (None: outside ``engines/`` or its registry)."""
    names = module.split(".")
    return names[2] if len(names) > 3 and names[1] == "engines" else None


def engine_imports() -> list[str]:
    """Imports of an engine folder's modules from outside it: from another engine folder, or
    from a part other than :data:`ENGINE_IMPORTERS` (counting imports inside functions)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, target, line in imports(path):
            engine = engine_of(target) or (target.split(".")[2] if target.count(".") == 2 and part_of(target) == "engines" else None)
            if engine is None or engine_of(module) == engine:
                continue
            if engine_of(module) is not None or part_of(module) not in ENGINE_IMPORTERS | {"engines"}:
                wrong.append(f"{path.name}:{line} {module} -> {target}: an engine's module imported outside its folder")
    return wrong


def test_only_the_engine_folders_import_an_engine():
    assert engine_imports() == []


def test_every_part_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert parts <= set(LAYER_OF), sorted(parts - set(LAYER_OF))


if __name__ == "__main__":  # make lint
    problems = upward_imports() + adapter_inner_imports() + engine_imports()
    problems += [f"import circle: {c}" for c in import_circles()]
    print("\n".join(problems) or "layers: every import runs down")
    raise SystemExit(1 if problems else 0)
