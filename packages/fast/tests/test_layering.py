"""Inside swiftkv_fast imports only go down: engine -> executor -> worker -> model -> attention / kernels /
distributed, and the shared top-level modules (config, sampler, ...) import none of those layers but the
bottom ones. One module, model/loader.py, imports swiftkv_reference, and any module may import its
`memory` (how much memory a device has: a fact about the host, no model math). Imports under
`if TYPE_CHECKING:` are annotations only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import swiftkv_fast

ROOT = Path(swiftkv_fast.__file__).parent
LAYERS = {"engine": 4, "executor": 3, "worker": 2, "model": 1, "attention": 0, "kernels": 0, "distributed": 0}
SHARED = {"config", "envs", "logger", "outputs", "sampler", "sampling_params", "scheduler_output"}
REFERENCE_IMPORTER = "model/loader.py"
REFERENCE_FOR_ALL = {"swiftkv_reference.memory"}


def _runtime_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _rank(module: str) -> int | None:
    """The layer of a swiftkv_fast submodule ('swiftkv_fast.worker.kv_cache' -> 2); None outside them."""
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "swiftkv_fast" else None


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        yield rel.as_posix(), rel.parts[0].removesuffix(".py"), _runtime_imports(path)


def test_imports_only_go_down():
    bad = []
    for rel, top, imports in _modules():
        if top in LAYERS:
            limit = LAYERS[top]
        elif top in SHARED:
            limit = LAYERS["attention"]
        else:
            continue
        for name in imports:
            rank = _rank(name)
            if rank is not None and rank > limit:
                bad.append(f"{rel} imports {name}")
            if top in SHARED and rank is None and name.startswith("swiftkv_fast."):
                if name.split(".")[1] not in SHARED:  # llm, inputs, cli, entrypoints sit above the engine
                    bad.append(f"{rel} imports {name}")
    assert not bad, "imports that go up:\n" + "\n".join(bad)


def test_one_module_imports_swiftkv_reference():
    importers = [
        rel
        for rel, _, imports in _modules()
        if any(n.split(".")[0] == "swiftkv_reference" and n not in REFERENCE_FOR_ALL for n in imports)
    ]
    assert importers == [REFERENCE_IMPORTER]
