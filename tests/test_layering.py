"""The package's imports run one way: kernels <- step <- attention <- spec_decode <- config <- worker <- the entry
points (plugin, cli, calibration, testing), and no two modules import each other, directly or around a loop. Every
import counts, module-level or inside a function."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_bole"

# Tier of each top-level part of the package; a module may import its own part and the parts of lower tiers.
TIERS = {
    "kernels": 0,      # Triton kernels and their torch references
    "step": 1,         # what one engine step carries: the forest, host copies
    "attention": 2,    # Bole's layers (GDN, tree attention) and their graph mode
    "spec_decode": 3,  # drafters, budget rules, the walk, sampling
    "config": 4,       # the user's speculative config, validated
    "worker": 5,       # the model runner, scheduler and worker
    "plugin": 6, "cli": 6, "calibration": 6, "testing": 6, "__init__": 6,
}
# Importable from every tier; they import nothing else of the package.
BASE = {"logger", "errors", "envs", "_vllm_compat"}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of the package in ``path``."""
    module = "vllm_bole." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if path.name == "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("vllm_bole")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module] if node.module and node.module.startswith("vllm_bole") else []
            found += [(node.lineno, n) for n in names]
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        part = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"
        for line, target in _imports(path):
            other = _part(target)
            if other == part:
                continue
            if part in BASE:
                if other not in BASE:
                    bad.append(f"{rel}:{line} imports {target} (a base module imports only base modules)")
            elif other not in BASE and TIERS[other] > TIERS[part]:
                bad.append(f"{rel}:{line} imports {target}: {part} (tier {TIERS[part]}) must not import {other} "
                           f"(tier {TIERS[other]})")
    return bad


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (an imported name is counted as its module)."""
    imports = {}
    for path in PACKAGE.rglob("*.py"):
        module = "vllm_bole." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        imports[module.removesuffix(".__init__")] = [target for _, target in _imports(path)]

    def known(name: str) -> str:
        while name and name not in imports:
            name = name.rpartition(".")[0]
        return name

    return {m: {known(t) for t in targets if known(t) not in ("", m)} for m, targets in imports.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert not _cycles(_module_graph())


def test_the_cycle_check_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_part_has_a_tier():
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts == set(TIERS) | BASE


def test_imports_run_one_way():
    assert not _violations(), "\n".join(_violations())


def test_the_check_sees_relative_and_function_level_imports(tmp_path, monkeypatch):
    """An upward import inside a function, written relatively, is reported."""
    fake = tmp_path / "vllm_bole"
    (fake / "attention").mkdir(parents=True)
    (fake / "attention" / "layer.py").write_text("def f():\n    from ..worker.model_runner import X\n")
    (fake / "attention" / "ok.py").write_text("from ..step.forest import StepForest\nfrom .layer import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _violations() == ["attention/layer.py:2 imports vllm_bole.worker.model_runner: attention (tier 2) must "
                             "not import worker (tier 5)"]
