"""The package's modules import each other without cycles (function-level imports included).

A cycle hidden in a function body still ties two layers together: the pure core must not
reach up into rendering or file reading (issue 12, item 8). Imports under ``TYPE_CHECKING``
count too (issue 29): a type-only import is still a dependency a reader has to follow. And no
module imports a private module (``_name``) of another package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import batchfit

SRC = Path(batchfit.__file__).resolve().parent.parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in (SRC / "batchfit").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(sub) for sub in ast.walk(node))
    return skip


def _imports(path: Path, modules: dict[str, Path], *, type_checking: bool = False) -> set[str]:
    """The package's modules that ``path`` imports; those under ``TYPE_CHECKING`` only with ``type_checking``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if type_checking else _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchfit"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("batchfit"))
    return found & modules.keys()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles():
    modules = _module_names()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_package_has_no_import_cycles_counting_type_only_imports():
    modules = _module_names()
    graph = {name: _imports(path, modules, type_checking=True) - {name} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The layers of the package, lowest first (DESIGN.md "Layers"): a module may import its own
# package and the layers below it, never one above (nor one beside it on the same layer).
LAYERS = (
    ("errors",),
    ("validation", "dtypes", "fileio", "patching"),
    ("plan",),
    ("batches",),
    ("parallel",),
    ("memory",),
    ("logprobs",),
    ("models",),
    ("train",),
    ("budget", "autobatch"),
    ("frameworks",),
    ("integrations",),
    ("cli",),
)
# Plain modules, not one of the layers' packages.
_ENTRY_POINTS = ("batchfit", "batchfit.__main__")


def _layer(module: str) -> tuple[int, str]:
    top = module.split(".")[1]
    for level, names in enumerate(LAYERS):
        if top in names:
            return level, top
    raise AssertionError(f"{module} is in no layer of LAYERS; add its package there")


def _readme_layers() -> tuple[tuple[str, ...], ...]:
    """The packages of the README's "Layout" table, a row each, in the table's order."""
    readme = (SRC.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return tuple(tuple(re.findall(r"`(\w+)`", row.split("|")[1])) for row in rows)


def test_the_readmes_layout_table_lists_the_layers_in_the_order_the_import_check_holds():
    assert _readme_layers() == LAYERS


def test_every_import_goes_down_the_layers():
    modules = _module_names()
    upward = []
    for name, path in modules.items():
        if name in _ENTRY_POINTS:
            continue
        level, package = _layer(name)
        for target in _imports(path, modules) - {name}:
            if target in _ENTRY_POINTS:
                if package != "cli":  # the root re-exports every layer: only the top may import it
                    upward.append(f"{name} -> {target} (the package root re-exports every layer)")
                continue
            target_level, target_package = _layer(target)
            if target_package != package and target_level >= level:
                upward.append(f"{name} -> {target}")
    assert upward == []


CORE = ("errors", "validation", "dtypes", "plan", "batches", "logprobs")


def _imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_core_does_not_import_torch_distributed():
    core = {n: p for n, p in _module_names().items() if n not in _ENTRY_POINTS and n.split(".")[1] in CORE}
    offenders = sorted(
        name
        for name, path in core.items()
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in _imported_names(path))
    )
    assert offenders == []


def _is_private(module: str) -> bool:
    return module.rsplit(".", 1)[-1].startswith("_")


def _package(module: str, path: Path) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to that package)."""
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_module_imports_a_private_module_of_another_package():
    # batchfit's own modules (torch's private modules, e.g. torch._subclasses, are the only home of
    # what the memory layer needs); imports under TYPE_CHECKING count too
    modules = _module_names()
    offenders = sorted(
        f"{name} -> {target}"
        for name, path in modules.items()
        for target in _imports(path, modules, type_checking=True)
        if _is_private(target) and target.rsplit(".", 1)[0] != _package(name, path)
    )
    assert offenders == []


def test_a_private_module_is_one_named_with_an_underscore():
    assert _is_private("batchfit.logprobs._common")
    assert not _is_private("batchfit.logprobs.chunked")
    assert _package("batchfit.logprobs", SRC / "batchfit" / "logprobs" / "__init__.py") == "batchfit.logprobs"
    assert _package("batchfit.train.micro_batch_step", SRC / "batchfit" / "train" / "step.py") == "batchfit.train"


# The README's "Layout": the core (CORE above) holds no device code and talks to no other rank, so
# every rank computes the same plan alone; it measures nothing either (measuring lives above it).
_NOT_IN_THE_CORE = ("torch.cuda", "torch.distributed", "batchfit.memory", "batchfit.parallel")


def _reaches(name: str) -> str | None:
    return next((banned for banned in _NOT_IN_THE_CORE if name == banned or name.startswith(f"{banned}.")), None)


def _device_and_rank_code(path: Path) -> list[str]:
    """Each import of, or attribute path into, ``_NOT_IN_THE_CORE`` in ``path`` (function bodies included)."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]  # torch.cuda.synchronize(), torch.distributed.get_rank()
        found.update((node.lineno, hit) for hit in map(_reaches, names) if hit)
    return [f"line {line}: {hit}" for line, hit in sorted(found)]


def test_the_core_has_no_device_rank_or_measuring_code():
    offenders = {
        name: hits
        for name, path in sorted(_module_names().items())
        if name not in _ENTRY_POINTS and name.split(".")[1] in CORE and (hits := _device_and_rank_code(path))
    }
    assert offenders == {}


def test_the_core_check_finds_device_code(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import torch\nfrom torch import distributed\nfrom batchfit.memory.sizes import MiB\n"
        "def f():\n    from batchfit import parallel\n    torch.cuda.synchronize()\n"
    )
    assert _device_and_rank_code(module) == [
        "line 2: torch.distributed",
        "line 3: batchfit.memory",
        "line 5: batchfit.parallel",
        "line 6: torch.cuda",
    ]


def test_no_two_modules_share_a_file_name():
    # a name says what a module holds without its package (issue 29): budget/step.py beside
    # train/step.py and frameworks/step.py read as one thing; a package's __init__ is exempt
    by_name: dict[str, list[str]] = {}
    for name, path in _module_names().items():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(name)
    assert {file: names for file, names in by_name.items() if len(names) > 1} == {}


# NOTE [ Backends say what they can do ] (batchfit.memory.base): outside memory/, code asks a
# backend what it can do, never which one it is.
_BACKEND_NAMES = {"cpu", "cuda", "estimate"}


def _backend_name_branches(source: str) -> list[str]:
    """Each comparison of a backend (an expression naming ``backend`` or ``be``) with a backend's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = [
            n.value
            for side in sides
            for n in ast.walk(side)
            if isinstance(n, ast.Constant) and n.value in _BACKEND_NAMES
        ]
        subjects = [ast.unparse(side) for side in sides if not isinstance(side, (ast.Constant, ast.Tuple))]
        if names and any("backend" in s or s.split(".")[0] == "be" for s in subjects):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_branch_on_a_backends_name_outside_memory():
    offenders = {
        name: hits
        for name, path in sorted(_module_names().items())
        if not name.startswith("batchfit.memory")
        and (hits := _backend_name_branches(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}


def test_the_backend_name_check_finds_a_branch():
    assert _backend_name_branches('if be.name == "cpu":\n    pass\n') == ["line 1: be.name == 'cpu'"]
    assert _backend_name_branches('x = plan.backend != "cuda"\n') == ["line 1: plan.backend != 'cuda'"]
    assert _backend_name_branches('ok = backend not in ("cpu", "cuda")\n') != []
    assert _backend_name_branches('ok = param.device.type == "cuda" or offload == "cpu"\n') == []


# NOTE [ Strategies say what they do ] (batchfit.parallel.strategies): outside parallel/, code asks
# a Sharding's spec what its strategy does, never which one it is. A framework's own strategy
# strings (verl's "fsdp", OpenRLHF's stage names) are its facts: a frameworks/ module compares
# its config's `strategy` variable, or keeps an explicit table of batchfit's names (a dict or a
# tuple bound to a name), but never a `.strategy` attribute with a literal name.
_STRATEGY_NAMES = {"none", "ddp", "fsdp1", "fsdp2", "zero1", "zero2"}
_STRATEGY_TUPLES = {"STRATEGIES", "FSDP_STRATEGIES", "ZERO_STRATEGIES"}


def _names_a_strategy(node: ast.AST) -> bool:
    """A literal naming one of batchfit's strategies (or a tuple/list/set holding one), or a tuple of them."""
    if isinstance(node, ast.Constant):
        return node.value in _STRATEGY_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_strategy(e) for e in node.elts)
    if isinstance(node, ast.Starred):
        return _names_a_strategy(node.value)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in _STRATEGY_TUPLES


def _strategy_name_branches(source: str, *, framework: bool = False) -> list[str]:
    """Each comparison of a strategy (an ``x.strategy`` attribute; outside frameworks/ a name ``strategy`` too) with
    batchfit's strategy names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]

        def subject(side: ast.AST) -> bool:
            if isinstance(side, ast.Attribute):
                return side.attr == "strategy"
            return isinstance(side, ast.Name) and side.id == "strategy" and not framework

        if any(subject(s) for s in sides) and any(_names_a_strategy(s) for s in sides if not subject(s)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _strategy_offenders() -> dict[str, list[str]]:
    return {
        name: hits
        for name, path in sorted(_module_names().items())
        if not name.startswith("batchfit.parallel")
        and (
            hits := _strategy_name_branches(
                path.read_text(encoding="utf-8"), framework=name.startswith("batchfit.frameworks")
            )
        )
    }


def test_no_branch_on_a_strategys_name_outside_parallel():
    assert _strategy_offenders() == {}


def test_the_strategy_name_check_finds_a_branch():
    assert _strategy_name_branches('if s.strategy == "fsdp2":\n    pass\n') == ["line 1: s.strategy == 'fsdp2'"]
    assert _strategy_name_branches('x = plan.sharding.strategy != "none"\n') == ["line 1: plan.sharding.strategy != 'none'"]
    assert _strategy_name_branches('ok = s.strategy in ("fsdp1", "fsdp2")\n') != []
    assert _strategy_name_branches('ok = s.strategy not in (*allowed, "none")\n') != []
    assert _strategy_name_branches("ok = s.strategy in ZERO_STRATEGIES\n") != []
    assert _strategy_name_branches('ok = strategy == "ddp"\n') != []
    # a framework's own config string, and comparisons that name no strategy of batchfit's
    assert _strategy_name_branches('ok = strategy == "fsdp2"\n', framework=True) == []
    assert _strategy_name_branches('ok = strategy == "megatron"\n') == []
    assert _strategy_name_branches("ok = run.strategy in _STAGES.values()\n") == []
    assert _strategy_name_branches('ok = s.spec.gathers_layers and s.offload == "cpu"\n') == []
