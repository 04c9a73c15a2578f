"""`import quantmla` must work without a GPU and must not initialize CUDA or import triton."""

import subprocess
import sys


def test_import_does_not_touch_cuda_or_triton():
    code = (
        "import sys, torch, quantmla, quantmla.cache.hf, quantmla.quant.formats, quantmla.mla.spec\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialized by import quantmla'\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def _import_graph() -> dict[str, set[str]]:
    """Module -> quantmla modules it imports anywhere (top level or inside functions), from the source."""
    import ast
    from pathlib import Path

    import quantmla

    root = Path(quantmla.__file__).parent
    mods = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_the_command_line_sits_above_its_commands():
    """No import circle through ``quantmla.cli`` (issue 10: ``cli`` <-> ``main_job``): nothing it reaches imports it."""
    from quantmla.cli import COMMANDS  # imported by name (importlib) when the parser is built

    graph = _import_graph()
    seen, todo = set(), list(graph["quantmla.cli"]) + [module for module, _ in COMMANDS]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert "quantmla.main_job" in seen and "quantmla.cli" not in seen


def test_no_import_circles():
    """No module reaches itself through the modules it imports (issue 10 named three circles: ``cli`` <->
    ``main_job``, ``kernels/dispatch`` <-> ``paged`` <-> ``reference`` <-> ``triton_decode``, ``models/convert``
    <-> ``heal``); lazy imports inside functions count."""
    graph = _import_graph()
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
    assert not circles, f"modules on an import circle: {sorted(circles)}"
