"""flexdma/ and benchmarks/ import without cycles, in any order, and no function-local import of
the project's own modules hides one (except the optional-dependency ones allowed below)."""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flexdma", "benchmarks")

# Modules that import triton at module level (the GPU kernels, the GPU-only benchmarks), and entry
# scripts that run on import.
NEEDS_TRITON = {
    "flexdma.dense._block_tiles",
    "flexdma.perkey.triton",
    "flexdma.perkey.triton_rows",
    "scripts.dev.select_bench",
    "scripts.dev.cuda_dev",
    "scripts.dev.flex_check",
    "scripts.dev.flex_options",
    "scripts.dev.perkey_dev",
    "scripts.dev.kernel_times",
    "scripts.dev.flex_docmask_options",
    "scripts.dev.flex_probe",
    "scripts.dev.host_parts",
}
ENTRY_SCRIPTS = {"benchmarks.__main__"}

# Function-local imports of the project's own modules that are allowed: each loads an optional or
# heavy dependency on first use, none breaks a cycle. (file, imported module)
ALLOWED_LOCAL = {
    ("flexdma/dense/attention.py", "flexdma.dense.flex"),  # torch's FlexAttention (and triton), on first use
    ("flexdma/perkey/attention.py", "flexdma.perkey.flex"),  # the same, for the per-key path
    ("flexdma/perkey/ops.py", "flexdma.perkey.triton"),  # triton, on the first call that runs its kernels
    # triton: decode.rows_kernel, the one place that loads the few-rows kernel, on its first step
    ("flexdma/perkey/decode.py", "flexdma.perkey.triton_rows"),
    # triton, in the mode that runs the kernels; its summary of a report's CSV runs anywhere
    ("scripts/dev/ncu_samples.py", "scripts.dev.perkey_dev"),
}


def _files():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: Path):
    """(imported project module, lineno, inside a function) of each import in the file."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text())

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        yield alias.name, child.lineno, inside
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    base = ".".join(base + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                if base.split(".")[0] in PACKAGES:
                    for alias in child.names:
                        full = f"{base}.{alias.name}"
                        yield (full if _is_module(full) else base), child.lineno, inside
            yield from visit(child, inside)

    yield from visit(tree, False)


def _modules():
    return sorted(_module(p) for p in _files())


def test_no_function_local_project_imports():
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        for name, line, inside in _imports(path):
            if inside and (rel, name) not in ALLOWED_LOCAL:
                found.append(f"{rel}:{line}: {name}")
    assert not found, "function-local imports of project modules (move them to the top):\n" + "\n".join(found)


def test_no_import_cycle():
    """Imports form a DAG, function-local ones counted: a local import that closes a cycle only
    hides it until the function runs (edges to a module's own parent packages aside, which Python
    always imports first). Every cycle is listed, one path through each group of modules that
    import one another."""
    mods = set(_modules())
    graph = {}
    for path in _files():
        m = _module(path)
        # `from .. import x` names the package only when x is not a module: an edge to an ancestor.
        graph[m] = {n for n, _, _ in _imports(path) if n in mods and n != m and not m.startswith(n + ".")}
    cycles = [_cycle_through(graph, group) for group in _strongly_connected(graph) if len(group) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _strongly_connected(graph):
    """The graph's strongly connected components (Tarjan's algorithm), each a sorted list."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

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
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _cycle_through(graph, group):
    """One cycle from the group's first module back to it, inside the group (breadth first: a
    shortest one)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in its component {group}")


def _importable():
    have_triton = importlib.util.find_spec("triton") is not None
    return [m for m in _modules() if m not in ENTRY_SCRIPTS and (have_triton or m not in NEEDS_TRITON)]


def _orders():
    mods = _importable()
    shuffled = [random.Random(seed).sample(mods, len(mods)) for seed in (0, 1)]
    # Each package's leaves first, then the rest: an entry through a submodule, not the package.
    leaves_first = sorted(mods, key=lambda m: (-m.count("."), m))
    return {
        "sorted": mods,
        "reversed": mods[::-1],
        "leaves-first": leaves_first,
        "shuffled-0": shuffled[0],
        "shuffled-1": shuffled[1],
    }


@pytest.mark.parametrize("order", list(_orders()))
def test_every_module_imports_in_order(order):
    mods = _orders()[order]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, *mods], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, f"importing in order {mods} failed:\n{res.stderr[-3000:]}"


def test_flex_attention_loads_on_first_use():
    """`import flexdma` and calls that do not run FlexAttention leave it (and triton) unloaded."""
    code = (
        "import sys, torch, flexdma\n"
        "q = torch.randn(1, 40, 2, 16)\n"
        "b = torch.randn(1, 2, 1, 40)\n"
        "flexdma.flash_dma_attention(q, q, q, attn_bias=b, keep_window_size=5, is_causal=True, backend='cpu')\n"
        "flexdma.flash_dma_attention(q, q, q, attn_bias=b, is_causal=True, backend='cpu')\n"
        "assert 'flexdma.dense.flex' not in sys.modules, 'flexdma.dense.flex was imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
