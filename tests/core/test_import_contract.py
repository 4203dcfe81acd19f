"""The layers of stages/, read from every module's imports (module level and inside functions):

- stages/core imports nothing from stages.families, stages.tiny or a module above it (stages/<name>.py,
  the stage registry, the train package);
- no stage module imports another stage's (the stages of stages/registry.py: a module, or the train
  package, whose own modules import each other); what two stages share lives in stages/core;
- stages/families imports no stage module, and no family folder imports another family folder (each
  imports stages.core, stages.tiny, the shared family modules and stages/families/common/, and itself);
  common/ and the shared family modules import no family folder;
- the stages.* modules import one another at module level without a cycle.

    .venv/bin/python -m pytest -q tests/core/test_import_contract.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = ROOT / "stages"

# (importer, imported) -> why it stays; a new violation fails, and so does an entry that no longer applies.
ALLOWED: dict[tuple[str, str], str] = {
    ("stages.core.config_values", "stages.families"):
        "config validation checks the family name and the family's own limits on every load_config; "
        "passing the registry in would reach every caller of load_config",
    ("stages.core.verify", "stages.families"):
        "verify looks up the manifest's family for its kohya and ComfyUI layouts (verify.py is kept as is)",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(STAGES.rglob("*.py"))}
STAGE_MODULES = ({f"stages.{p.stem}" for p in STAGES.glob("*.py") if p.stem != "__init__"}
                 | {f"stages.{p.parent.name}" for p in STAGES.glob("*/__init__.py")} - {"stages.core", "stages.families", "stages.tiny"})
# the stages as the registry declares them; each one's own modules (a package's too) may import each other
REGISTERED = {s.module for s in __import__("stages.registry", fromlist=["ALL"]).ALL}
FAMILY_FOLDERS = {f"stages.families.{p.name}" for p in (STAGES / "families").iterdir()
                  if (p / "__init__.py").is_file() and p.name != "common"}


def _targets(node: ast.AST, module: str, path: Path) -> list[str]:
    """The modules an import statement names: `from a import b` is a.b where that is a module, else a."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        head = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(head + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def imports(module: str) -> set[str]:
    """Every module `module` imports, anywhere in its file (functions and TYPE_CHECKING blocks too)."""
    path = MODULES[module]
    return {t for node in ast.walk(ast.parse(path.read_text())) for t in _targets(node, module, path)}


def module_level_imports(module: str) -> set[str]:
    """The stages.* modules `module` imports when it is imported (not in functions or TYPE_CHECKING)."""
    path, found = MODULES[module], set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.If):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)
            else:
                found.update(_targets(node, module, path))

    visit(ast.parse(path.read_text()).body)
    return {t for t in found if t in MODULES and t != module}


def _under(name: str, packages: set[str]) -> str | None:
    return next((p for p in packages if name == p or name.startswith(p + ".")), None)


def violations() -> dict[tuple[str, str], str]:
    found = {}
    for module in MODULES:
        for target in imports(module):
            own_stage, other_stage = _under(module, REGISTERED), _under(target, REGISTERED)
            if own_stage and other_stage and other_stage != own_stage:
                found[(module, target)] = f"the stage {own_stage} imports the stage {other_stage}"
            elif module.startswith("stages.core"):
                if _under(target, {"stages.families", "stages.tiny"} | STAGE_MODULES):
                    found[(module, target)] = "core imports a family, tiny or a stage module"
            elif module.startswith("stages.families"):
                own = _under(module, FAMILY_FOLDERS)
                other = _under(target, FAMILY_FOLDERS)
                if _under(target, STAGE_MODULES):
                    found[(module, target)] = "a family module imports a stage module"
                elif other and other != own:
                    found[(module, target)] = f"{own or module} imports the family folder {other}"
    return found


def _allowed(importer: str, target: str) -> bool:
    return any(importer == i and (target == t or target.startswith(t + ".")) for i, t in ALLOWED)


def test_layers_hold():
    found = violations()
    new = {k: why for k, why in found.items() if not _allowed(*k)}
    assert not new, "\n".join(f"{i} -> {t}: {why}" for (i, t), why in sorted(new.items()))


def test_the_stage_rule_would_see_a_stage_importing_another(tmp_path):
    """The rule reads `from stages import <stage>` and `from stages.<stage> import ...` alike."""
    tree = ast.parse("from stages import cache_latents\nfrom stages.train.checkpoints import Checkpoints\n")
    targets = {t for node in ast.walk(tree) for t in _targets(node, "stages.sample", STAGES / "sample.py")}
    assert {_under(t, REGISTERED) for t in targets} == {"stages.cache_latents", "stages.train"}


def test_every_allowed_exception_still_applies():
    found = violations()
    stale = [k for k in ALLOWED if not any(i == k[0] and (t == k[1] or t.startswith(k[1] + ".")) for i, t in found)]
    assert not stale, f"no longer needed, remove from ALLOWED: {stale}"


def test_no_import_cycle_at_module_level():
    graph = {m: module_level_imports(m) for m in MODULES}
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            walk(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        walk(module, [])


def test_the_contract_sees_the_tree():
    """The rules read real folders: a rename that empties a set would make them pass vacuously."""
    assert {"stages.train", "stages.encode_captions", "stages.cache_latents", "stages.export_lora"} <= STAGE_MODULES
    assert {"stages.train", "stages.encode_captions", "stages.cache_latents", "stages.export_lora",
            "stages.sample"} == REGISTERED
    assert {"stages.train.stage", "stages.train.trainer", "stages.train.checkpoints"} <= set(MODULES)
    assert {"stages.families.flux", "stages.families.flux_kontext", "stages.families.qwen_image"} <= FAMILY_FOLDERS
    assert "stages.families.common.bfl" in MODULES


def test_no_getattr_on_a_family_outside_families():
    """A family's optional traits are declared once (stages.families.base.FamilyTraits): read as attributes."""
    family_names = {"family", "fam", "self.family"}
    found = []
    for path in [ROOT / "pipeline.py", *STAGES.rglob("*.py")]:
        if (STAGES / "families") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and (ast.unparse(node.args[0]) in family_names or "get_family(" in ast.unparse(node.args[0]))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_every_family_inherits_the_declared_traits():
    from stages.families import FAMILIES, get_family
    from stages.families.base import FamilyTraits

    assert [name for name in FAMILIES if not isinstance(get_family(name), FamilyTraits)] == []


def test_every_module_imports_first():
    """Each stages.* module imports as the first one of its process: the registry loads family modules by
    name at run time, where an import cycle the static graph cannot see would surface."""
    import subprocess
    import sys

    code = ("import importlib, sys\nbad = []\n"
            f"for m in {sorted(MODULES)!r}:\n"
            "    for k in [k for k in sys.modules if k == 'stages' or k.startswith('stages.')]:\n"
            "        del sys.modules[k]\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr[-2000:]


def test_no_getattr_on_a_stage_outside_the_registry():
    """A stage's optional hooks are declared once, with their defaults (stages/registry.py): read as
    attributes of its registry entry, never probed on the stage's module."""
    stage_names = {"stage", "stage_module", "module_of_stage"} | {m.rpartition(".")[2] for m in REGISTERED}
    found = []
    for path in [ROOT / "pipeline.py", *STAGES.rglob("*.py")]:
        if path == STAGES / "registry.py" or (STAGES / "families") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and ast.unparse(node.args[0]) in stage_names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_every_familys_traits_are_read_without_torch():
    """`status` and a no-op `run` read family traits (config checks, experts, pipeline class, LoRA prefix): every
    family's object is made, and its traits read, without importing torch, diffusers or transformers (its module
    takes torch on first use: stages/core/lazy.py)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys\nfrom stages.families import FAMILIES, get_family\n"
            "for name in FAMILIES:\n"
            "    f = get_family(name)\n"
            "    (f.pipeline_class, f.lora_prefix, f.experts, f.denoiser_components, f.pipeline_modules)\n"
            "print('heavy:', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stdout, out.stdout
