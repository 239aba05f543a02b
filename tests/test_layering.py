"""The package's import layering (docs/design.md), read from the sources: every import, module-level or
inside a function, goes down the layers, and there is no import circle.

    core (checks, formats, folds, scheme, layouts, operands, quantize, references, targets, chunk_attention, log)
      <- compile (jit, compile cache, inspect)
      <- shared device components (device, pipeline, softmax, split_merge, work_list, window_tiles, warp_mma,
         barriers, query_rows, decode_kernel)
      <- kernels: arch kernels (hopper/, blackwell/) over the host launch path (launch) and the helper kernels
         it runs (kernels/)
      <- arch registry (archs)
      <- public API, cache and integrations
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent / "foscar"

CORE = {"checks", "formats", "folds", "scheme", "operands", "quantize", "reference", "targets", "layouts", "log",
        "chunk_attention"}
COMPILE = {"jit", "compile_cache", "inspect"}
DEVICE = {"device", "pipeline", "softmax", "split_merge", "work_list", "window_tiles", "warp_mma", "barriers",
          "query_rows", "decode_kernel"}
KERNELS = {"kernels": 3, "launch": 3, "hopper": 4, "blackwell": 4}  # host path, helper kernels below the arch kernels


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    if top in CORE:
        return 0
    if top in COMPILE:
        return 1
    if top in DEVICE:
        return 2
    if top in KERNELS:
        return KERNELS[top]
    return 5 if top == "archs" else 6


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {t for t in found if t in known and t != name}


def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_import_goes_down_the_layers():
    wrong = [f"{m} -> {t}" for m, targets in graph().items() for t in targets if layer(t) > layer(m)]
    assert not wrong, wrong


def test_kernels_never_import_the_public_api_or_the_registry():
    wrong = [f"{m} -> {t}" for m, targets in graph().items() if 2 <= layer(m) <= 4 for t in targets if layer(t) >= 5]
    assert not wrong, wrong


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
