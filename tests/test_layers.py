"""The project's modules form layers: a module imports only modules of lower layers (or its own,
without a cycle), wherever the import statement sits, inside functions and `if TYPE_CHECKING:`
blocks included. `python tests/test_layers.py` prints the import graph, layer by layer."""

import ast
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# lowest first; scripts/ sit above everything and are never imported by the core
LAYERS = [
    # the method, specache/: torch and the standard library alone
    ["specache.lowbit", "specache.guess", "specache.tiers", "specache.prefill"],
    ["specache.config", "specache.integer", "specache.sparse"],
    ["specache.ops", "specache.pinned"],
    ["specache.select"],
    ["specache.step", "specache.state"],
    ["specache.layer"],
    ["specache.cache"],
    ["specache.rows"],  # serving's rows, apart from the core
    ["specache"],  # the package's public names
    # its kernels, which register themselves for the ops
    ["specache.kernels.cpu_build", "specache.kernels.cpu_ops"],
    [
        "specache.kernels.lowbit_cpu",
        "specache.kernels.lowbit_triton",
        "specache.kernels.merge_cpu",
        "specache.kernels.rank_cpu",
    ],
    # the float kernels' checks and ctypes struct, and Triton's unpacking
    [
        "specache.kernels.lowbit_int_cpu",
        "specache.kernels.lowbit_sparse_cpu",
        "specache.kernels.lowbit_sparse_triton",
    ],
    ["specache.kernels"],  # register()
    ["specache.hf"],  # transformers and the package alone
    # the host
    ["config", "tokenizer", "serving.openai_api"],
    ["kernels.host_ops"],  # the host's own kernels, on the package's build and dispatch
    ["kernels.linear_cpu", "kernels.dense_cpu"],
    ["model"],
    ["quantize", "convert"],
    # the caches, caches/
    ["caches.full", "caches.disk_tier"],
    ["caches.stats", "caches.eviction"],
    ["caches.plugged"],
    ["caches.by_name"],  # make_cache
    ["checkpoint"],
    ["generation", "options", "tp"],
    ["generate", "serving.batching"],
    ["serving.serve", "chat"],
]


def project_modules() -> dict[str, Path]:
    files = [
        *REPO_ROOT.glob("*.py"),
        *REPO_ROOT.glob("kernels/*.py"),
        *REPO_ROOT.glob("specache/*.py"),
        *REPO_ROOT.glob("specache/kernels/*.py"),
        *REPO_ROOT.glob("caches/*.py"),
        *REPO_ROOT.glob("serving/*.py"),
        *REPO_ROOT.glob("scripts/**/*.py"),
    ]
    return {
        ".".join(f.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): f
        for f in files
        # the package's __init__ files are modules of their own (its public names, register());
        # the host's (caches/, serving/) hold their docstrings alone
        if f.name != "__init__.py" or f.relative_to(REPO_ROOT).parts[0] == "specache"
    }


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports, from any statement anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from package import module` depends on that module (the package's __init__ runs
            # first, but a package's own modules import each other so)
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n for n in submodules if n in modules] or [node.module]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports(path, set(modules)) - {name} for name, path in modules.items()}


def layer_of(module: str) -> int:
    if module.startswith("scripts."):
        return len(LAYERS)
    return next(i for i, layer in enumerate(LAYERS) if module in layer)


def test_every_module_has_a_layer():
    unplaced = [
        m
        for m in graph()
        if not m.startswith("scripts.") and not any(m in layer for layer in LAYERS)
    ]
    assert not unplaced, f"put these modules in a layer of LAYERS: {unplaced}"


def test_no_module_imports_one_above_it():
    upward = [
        (a, b) for a, targets in graph().items() for b in targets if layer_of(b) > layer_of(a)
    ]
    assert not upward, f"imports of a higher layer (module -> what it imports): {upward}"


def test_the_package_imports_nothing_of_the_host():
    """Copy-paste and pip install: specache/ stands on torch and the standard library; its hf
    adapter on them and transformers."""
    edges = graph()
    package = [m for m in edges if m == "specache" or m.startswith("specache.")]
    assert "specache.hf" in package and "specache.cache" in package
    for module in package:
        assert all(t == "specache" or t.startswith("specache.") for t in edges[module]), module
    stdlib = set(sys.stdlib_module_names)
    for module in package:
        allowed = {"torch", "specache"} | {
            "specache.hf": {"transformers"},
            "specache.kernels.lowbit_triton": {"triton"},  # where it is installed
            "specache.kernels.lowbit_sparse_triton": {"triton"},
        }.get(module, set())
        tree = ast.parse(project_modules()[module].read_text(encoding="utf-8"))
        names = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        names |= {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert {name.split(".")[0] for name in names} <= stdlib | allowed, module


def test_there_are_no_import_cycles():
    edges = graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                raise AssertionError(
                    f"import cycle: {' -> '.join(path[path.index(target) :] + [target])}"
                )
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


if __name__ == "__main__":
    edges = graph()
    for i, layer in enumerate(LAYERS + [sorted(m for m in edges if m.startswith("scripts."))]):
        print(f"layer {i}:")
        for module in layer:
            print(f"  {module} -> {', '.join(sorted(edges.get(module, ()))) or '-'}")
    sys.exit(0)
