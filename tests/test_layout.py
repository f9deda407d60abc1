"""The layout's promises: a target family is one file in targets/, a drafter format one entry
in drafter/formats.py, parts import only lower parts, no import cycles, no long files or functions."""

import ast
import dataclasses
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import dflash_mlx.targets as targets
from dflash_mlx import generate_step, load_drafter, make_adapter, save_drafter
from dflash_mlx.drafter import formats
from conftest import ROOT, assert_varied, mlx_lm_greedy, tiny_drafter, tiny_target


@pytest.fixture
def toy_family(monkeypatch, tmp_path):
    """docs/examples/toy_family.py dropped into targets/ (a folder added to its path)."""
    shutil.copy(ROOT / "docs" / "examples" / "toy_family.py", tmp_path / "toy_family.py")
    monkeypatch.setattr(targets, "__path__", [*targets.__path__, str(tmp_path)])
    monkeypatch.setattr(targets, "ADAPTERS", targets.find_families(targets.__path__))
    yield
    sys.modules.pop("dflash_mlx.targets.toy_family", None)


def test_a_target_family_is_one_file(toy_family):
    model, _ = tiny_target("qwen3")
    model.model_type = "toy"
    target = make_adapter(model)
    assert type(target).__name__ == "ToyAdapter"
    prompt = [1, 17, 33, 2, 9, 100, 42]
    ref = mlx_lm_greedy(model, prompt, 120)
    assert_varied(ref)
    for kw in ({"block_size": 4}, {"tree_budget": 6}):
        out = [t for s in generate_step(mx.array(prompt), target, tiny_drafter(target), max_tokens=120, **kw)
               for t in s.tokens]
        assert out == ref, kw


def test_every_family_file_registers_itself():
    found = targets.find_families()
    assert found == targets.ADAPTERS
    assert {"llama", "qwen3", "qwen3_5", "gemma4_text", "qwen3_vl_moe"} <= set(found)
    from dflash_mlx.targets.llama import LlamaAdapter
    assert LlamaAdapter is found["llama"]


# A drafter format: where config.json keeps the ids and how weight names map (docs/architecture.md).
TOY_FORMAT = formats.DrafterFormat("ToyDraftModel", "toy_draft", ids_at_top=True,
                                   renames=(("draft.fc.", "fc."), ("draft.norm.", "hidden_norm.")))


def test_a_drafter_format_is_one_entry_in_formats(monkeypatch, tmp_path):
    monkeypatch.setitem(formats.FORMATS, TOY_FORMAT.architecture, TOY_FORMAT)
    _, target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.args = dataclasses.replace(drafter.args, architecture=TOY_FORMAT.architecture)
    folder = save_drafter(drafter, tmp_path / "toy")
    config = (folder / "config.json").read_text()
    assert '"ToyDraftModel"' in config and '"mask_token_id"' in config and "dflash_config" not in config
    loaded = load_drafter(str(folder))
    assert loaded.args.format is TOY_FORMAT
    from dflash_mlx.drafter.checkpoint import read_safetensors
    names = set(read_safetensors(folder))
    assert "draft.fc.weight" in names and "fc.weight" not in names
    prompt = mx.array([1, 17, 33, 2, 9, 100, 42])
    run = [[t for s in generate_step(prompt, target, d, max_tokens=40, block_size=4) for t in s.tokens]
           for d in (drafter, loaded.bind(target.embed, target.lm_head))]
    assert run[0] == run[1]


_TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _imports(path: Path, package: str, lazy: bool = False, type_checking: bool = True):
    """Modules (or ``module.name``) a file imports: at its top level, or with ``lazy`` inside
    functions and blocks too, ``if TYPE_CHECKING:`` blocks left out unless ``type_checking``; ``package``
    is the one its relative imports start from."""
    def walk(nodes):
        for node in nodes:
            if not type_checking and isinstance(node, ast.If) and ast.unparse(node.test) in _TYPE_CHECKING:
                yield from walk(node.orelse)
                continue
            yield node
            if lazy:
                yield from walk(ast.iter_child_nodes(node))

    for node in walk(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _modules():
    """Module name -> file, for every file in dflash_mlx/ (a package's ``__init__.py`` under its own name)."""
    files = {}
    for path in _sources():
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported_files(name: str, path: Path, files: dict):
    """The files of dflash_mlx/ that a module imports, imports inside functions included (not those
    under ``if TYPE_CHECKING:``, which do not run); ``dflash_mlx`` for the package's ``__init__``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for mod in _imports(path, package, lazy=True, type_checking=False):
        while mod and mod not in files:
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            yield mod


def test_no_import_cycles():
    """No circle of imports between files, imports inside functions included."""
    files = _modules()
    graph = {name: set(_imported_files(name, path, files)) for name, path in files.items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_module_imports_the_package_init():
    """Inside dflash_mlx/, names come from the module that defines them, not from ``dflash_mlx``'s
    ``__init__`` (``import dflash_mlx``, ``from dflash_mlx import X``, ``from .. import X``)."""
    files = _modules()
    wrong = sorted(name for name, path in files.items()
                   if name != "dflash_mlx"
                   and "dflash_mlx" in _imported_files(name, path, files))
    assert not wrong, "modules importing the package __init__: " + ", ".join(wrong)


def test_the_decode_path_is_one_screen_in_five_files(monkeypatch):
    """The step is one function of at most 40 lines, and from ``stream_generate`` to the rollback of rejected
    drafts a call crosses at most 5 files of the package (traced, not read)."""
    import inspect

    from dflash_mlx import stream_generate
    from dflash_mlx.decode.batch import BatchDecoder
    from dflash_mlx.targets import base
    from conftest import ByteTokenizer

    source = inspect.getsource(BatchDecoder._step)
    assert len(source.splitlines()) <= 40, f"BatchDecoder._step: {len(source.splitlines())} lines"
    paths, real = [], base.rollback

    def traced(*args, **kwargs):
        frames = [f.filename for f in inspect.stack()]
        paths.append(frames[: next(i for i, f in enumerate(frames) if f.endswith("generate.py")) + 1])
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "rollback", traced)
    _, target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    text = "".join(r.text for r in stream_generate(target, ByteTokenizer(), [1, 5, 9], drafter, max_tokens=24,
                                                    block_size=4))
    assert text and paths
    package = str(ROOT / "dflash_mlx")
    files = {f for path in paths for f in path if f.startswith(package)} | {str(ROOT / "dflash_mlx" / "prompt_cache"
                                                                              / "rollback.py")}
    assert len(files) <= 5, sorted(files)


MAX_FILE, MAX_FUNCTION = 400, 60


def _sources():
    return sorted((ROOT / "dflash_mlx").rglob("*.py"))


def test_no_long_files_or_functions():
    """No file in dflash_mlx/ over 400 lines and no function over 60, without exceptions."""
    long = []
    for path in _sources():
        text = path.read_text()
        name = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_FILE:
            long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION:
                    long.append(f"{name}:{node.lineno} {node.name}: {size} lines")
    assert not long, "\n".join(long)


def test_the_package_stays_small():
    total = sum(len(path.read_text().splitlines()) for path in _sources())
    assert total <= 15_140, f"dflash_mlx/ holds {total} lines, over 15,140"


# The parts, lowest first. A package imports only packages of lower layers (imports inside
# functions count too); docs/architecture.md draws the same picture.
LAYERS = [
    {"errors"},
    {"atomic", "hub", "ranges", "protocol", "sampling", "stats", "prompt", "fingerprint"},
    {"owned", "kernels"},
    {"prompt_cache"},
    {"targets"},
    {"drafter"},
    {"decode"},
    {"pair"},
    {"chat", "serve", "bench", "train", "compare"},
    {"cli"},
]


def _part(module: str) -> str:
    """The part a module belongs to: its package under dflash_mlx, or its own name for a top-level file."""
    return module.split(".")[1]


def test_parts_import_only_lower_parts():
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    wrong = set()
    for path in _sources():
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.parts == ("dflash_mlx", "__init__"):
            continue  # the package's public names, imported lazily
        module = ".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)
        part = _part(module)
        assert part in layer, f"{path.relative_to(ROOT)}: its part {part!r} has no layer in LAYERS"
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for imported in _imports(path, package, lazy=True):
            if not imported.startswith("dflash_mlx.") or imported.count(".") < 1:
                continue
            other = _part(imported)
            if other in layer and other != part and layer[other] >= layer[part]:
                wrong.add(f"{part} -> {other} ({path.relative_to(ROOT)})")
    assert not wrong, "imports that climb or cross:\n" + "\n".join(sorted(wrong))
