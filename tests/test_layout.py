"""The package's layers import downward only (docs/architecture.md), and its folders are its import
names, so a checkout imports from its root with nothing installed."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "edgemoe"

# Lowest first. A module may import modules of its own layer and of the layers below it, never above.
LAYERS = [
    # models/: each architecture's config, names and router, which a store's spec is rebuilt with
    ("vocabulary", {"edgemoe.errors", "edgemoe.spec", "edgemoe.options", "edgemoe.files", "edgemoe.models"}),
    ("quant", {"edgemoe.quant"}),
    ("kernels", {"edgemoe.kernels"}),
    ("scheduling", {"edgemoe.scheduling"}),
    ("store", {"edgemoe.store"}),
    ("runtime", None),   # every module not named in another layer
    ("conversion", {"edgemoe.convert", "edgemoe.bench", "edgemoe.stats", "edgemoe.plots"}),
    ("application", {"edgemoe.cli", "edgemoe.commands", "edgemoe.__main__", "edgemoe.server", "edgemoe.chat"}),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if members and any(module == m or module.startswith(m + ".") for m in members):
            return i
    return next(i for i, (_, members) in enumerate(LAYERS) if members is None)


def imported_modules(path: Path) -> set[str]:
    """edgemoe modules imported anywhere in the file (top level or inside functions)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> set[str]:
    """edgemoe modules imported by `source`, a module of `package` (for relative imports)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            found.update(name if _is_module(name) else base for name in names)
    return {m for m in found if m == "edgemoe" or m.startswith("edgemoe.")}


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_layer_imports_only_itself_and_the_layers_below():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for target in imported_modules(path):
            if target == "edgemoe":   # the package root re-exports load(); only the top may use it
                target = "edgemoe.loader"
            if layer_of(target) > layer_of(module):
                violations.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                                  f"({LAYERS[layer_of(target)][0]})")
    assert violations == []


def test_the_rules_catch_an_upward_import():
    """The checker itself: a store module importing the runtime is found."""
    source = "from edgemoe.model import MoEModel\nfrom ..loader import load\n"
    assert imports_in(source, "edgemoe.store") == {"edgemoe.model", "edgemoe.loader"}
    assert layer_of("edgemoe.store.tiers") < layer_of("edgemoe.model")


def test_folders_are_import_names_so_a_checkout_imports_without_installing():
    """From the checkout's root (first on sys.path) every subpackage resolves to its own folder."""
    probe = ("import edgemoe.store, edgemoe.quant, edgemoe.kernels, edgemoe.scheduling as s; "
             "print(*(m.__file__ for m in (edgemoe.store, edgemoe.quant, edgemoe.kernels, s)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(PACKAGE / name / "__init__.py")
                                  for name in ("store", "quant", "kernels", "scheduling")]


def test_installing_edgemoe_exposes_no_bare_package(tmp_path):
    probe = "import importlib.util as u; print([n for n in ('store', 'quant', 'kernels') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
