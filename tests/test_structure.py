"""The code's layering, checked on its source (issue 22's "done when"): no module reaches into another's
private names, no import cycles (deferred imports included), the library never imports the gateway,
long functions say why, the step loop stays short and DESIGN.md's decode step names real files."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"vericache": ROOT / "backend" / "vericache", "vericache_lab": ROOT / "backend" / "vericache_lab",
            "vericache_gateway": ROOT / "gateway" / "vericache_gateway"}
STEP_LOOP = PACKAGES["vericache"] / "engine" / "step_loop.py"
LONG_FUNCTION = 60


def module_name(path: Path) -> str:
    for pkg, root in PACKAGES.items():
        if path.is_relative_to(root):
            parts = [pkg, *path.relative_to(root).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return "tests." + path.stem


def library_files() -> list[Path]:
    return sorted(p for root in PACKAGES.values() for p in root.rglob("*.py"))


def all_files() -> list[Path]:
    return library_files() + sorted((ROOT / "tests").glob("*.py"))


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a file defines: functions, classes, assignments, attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if is_private(n)}


def private_reaches() -> list[str]:
    """Every use of a private name of one of our files from another file: `from m import _x`, or
    `obj._x` where `_x` is defined in our code but not in the using file (third-party private ops,
    like torch's int4 matmul, are not our names and are not counted)."""
    trees = {p: ast.parse(p.read_text()) for p in all_files()}
    own = {p: defined_private_names(t) for p, t in trees.items()}
    ours = set().union(*own.values())
    found = []
    for path, tree in trees.items():
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (*PACKAGES, "conftest",
                                                                                             "test_gateway"):
                found += [f"{where}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                          if is_private(a.name)]
            elif isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr in ours:
                if node.attr not in own[path]:
                    found.append(f"{where}:{node.lineno} uses .{node.attr} of {ast.unparse(node.value)}")
    return found


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Our modules that ``path`` imports anywhere in it (module level or inside functions)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != me and not me.startswith(target + "."):  # a package's own __init__
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in library_files()}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


CACHE_INTERNALS = {"residual", "res_start", "committed", "q_seen", "fields"}   # CompressedKVCache's parts
CACHE_NAMES = {"full", "draft", "resident", "prefill_buf", "cache", "dst", "src", "buf", "ctx", "full_cache"}


def cache_field_reaches() -> list[str]:
    """Library code outside ``kv/`` reading or writing a KV cache's tensors or a compressed cache's
    parts: ``<cache>.k`` / ``<cache>.v`` (by the names caches go by) or the compressed cache's internals."""
    found = []
    for path in library_files():
        if path.is_relative_to(PACKAGES["vericache"] / "kv"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if (node.attr in ("k", "v") and owner in CACHE_NAMES) or (
                    node.attr in CACHE_INTERNALS and owner in CACHE_NAMES | {"draft"}):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_kv_caches_are_changed_through_their_methods_only():
    assert cache_field_reaches() == []


def test_no_module_uses_another_modules_private_names():
    assert private_reaches() == []


def test_the_checks_catch_what_they_look_for():
    """The analyses themselves: a cycle and a private reach are found when present."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert defined_private_names(ast.parse("def _f(_x): self._y = 1\n_z = 2")) == {"_f", "_x", "_y", "_z"}


def test_no_import_cycles_deferred_imports_included():
    graph = import_graph()
    assert len(graph) > 100 and any(graph.values())
    assert cycles(graph) == []


def test_the_library_never_imports_the_gateway_or_the_lab():
    """The core (``vericache``) imports neither the gateway nor the research harness (``vericache_lab``:
    bench, sim, eval, train, netlab, the predictions), which are its clients (issue 39)."""
    graph = import_graph()
    library = [m for m in graph if m.startswith("vericache.")]
    assert len(library) > 60 and any(m.startswith("vericache_lab.") for m in graph)
    assert [(m, sorted(d)) for m in library
            if (d := {x for x in graph[m] if x.startswith(("vericache_gateway", "vericache_lab"))})] == []


def test_long_functions_say_why():
    """A library function over 60 lines carries a comment starting "# Long:" saying why it is not split."""
    unexplained = []
    for path in library_files():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[node.lineno - 1 : node.end_lineno]
                if len(body) > LONG_FUNCTION and not any(line.strip().startswith("# Long:") for line in body):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(body)} lines)")
    assert unexplained == []


def test_the_step_loop_file_stays_short():
    assert STEP_LOOP.exists()
    assert len(STEP_LOOP.read_text().splitlines()) <= 250


def test_design_lists_a_decode_step_through_at_most_ten_real_files():
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("One decode step, file by file", 1)[1].split("\n\n", 1)[0]
    files = re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.M)
    assert 5 <= len(files) <= 10, files
    assert len(set(files)) == len(files)
    missing = [f for f in files if not (PACKAGES["vericache"] / f).exists()]
    assert missing == []
    assert "engine/step_loop.py" in files


def loop_reaches(source: str, name: str = "") -> list[str]:
    """Where source takes or keeps the step loop: a parameter or attribute named ``loop``, or an import
    of ``engine.step_loop``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.arg == "loop":
            found.append(f"{name}:{node.lineno} takes `loop`")
        elif isinstance(node, ast.Attribute) and node.attr == "loop":
            found.append(f"{name}:{node.lineno} uses .loop")
        elif isinstance(node, ast.ImportFrom) and node.module == "vericache.engine.step_loop":
            found.append(f"{name}:{node.lineno} imports the step loop")
    return found


def test_no_stage_holds_or_receives_the_step_loop():
    """The engine's stages (scheduler, runner, offload policy, remote half, request table, memory) are
    joined by plain data and the objects they need, never the loop (issue 31); only the ``Engine``
    (engine.py, the one door) holds one, and the runner neither builds nor imports one (issue 39)."""
    engine = PACKAGES["vericache"] / "engine"
    stages = [p for p in sorted(engine.glob("*.py")) if p.name not in ("step_loop.py", "engine.py", "__init__.py")]
    assert len(stages) >= 7 and "runner.py" in [p.name for p in stages]
    assert [f for p in stages for f in loop_reaches(p.read_text(), p.name)] == []
    runner = ast.parse((engine / "runner.py").read_text())
    execute = next(n for n in ast.walk(runner) if isinstance(n, ast.FunctionDef) and n.name == "execute")
    assert [a.arg for a in execute.args.args] == ["self", "plan"]
    # the check finds what it looks for
    assert len(loop_reaches("from vericache.engine.step_loop import StepLoop\ndef plan(loop): return self.loop")) == 3


def package_ties(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of the library's packages that import each other (each pair once)."""
    def pkg(m: str) -> str | None:
        parts = m.split(".")
        return parts[1] if parts[0] == "vericache" and len(parts) > 2 else None
    edges = {(pkg(m), pkg(d)) for m, ds in graph.items() for d in ds if pkg(m) and pkg(d) and pkg(m) != pkg(d)}
    return sorted((a, b) for a, b in edges if (b, a) in edges and a < b)


def test_no_two_packages_import_each_other():
    """Issue 31: the library's packages form a hierarchy (kv below compress, engine below remote, data
    below train and eval, the reports below bench and sim, kernels below kv)."""
    assert package_ties({"vericache.a.x": {"vericache.b.y"}, "vericache.b.y": {"vericache.a.z"}}) == [("a", "b")]
    assert package_ties(import_graph()) == []


# ---------------------------------------------------------------- the engine's one door (issue 39)
FRONT_ENDS = [PACKAGES["vericache"] / "serving", PACKAGES["vericache"] / "remote", PACKAGES["vericache_gateway"],
              ROOT / "model_repository"]
ENGINE_INTERNALS = {"loop", "runner", "requests", "seq", "round", "opts"}   # the loop, the runner, a Request's fields
INTERNAL_MODULES = ("vericache.engine.step_loop", "vericache.engine.runner", "vericache.engine.requests",
                    "vericache.engine.scheduler", "vericache.engine.memory", "vericache.engine.offload")


def engine_reach_ins(source: str, where: str) -> list[str]:
    """Attribute reads of the engine's internals and imports of its internal modules in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
            found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(INTERNAL_MODULES):
            found.append(f"{where}:{node.lineno} imports {node.module}")
    return found


def constructions(name: str) -> set[str]:
    """The library modules that call ``name(...)``."""
    return {module_name(p) for p in library_files() for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name}


def test_front_ends_reach_into_no_engine_internals():
    """serving/, remote/, the gateway and the Triton model use the ``Engine``'s API only."""
    files = [p for d in FRONT_ENDS for p in sorted(d.rglob("*.py"))]
    assert len(files) > 20
    found = [f for p in files for f in engine_reach_ins(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []
    # the check finds what it looks for
    assert len(engine_reach_ins("svc.loop.runner.check_request(x)\nreq.seq.text()\n"
                                "from vericache.engine.step_loop import StepLoop", "x")) == 4


def test_the_step_loop_and_the_model_runner_are_built_in_one_module():
    assert constructions("StepLoop") == constructions("ModelRunner") == {"vericache.engine.engine"}



def calls_load_model(text: str) -> bool:
    """Whether code calls ``model.loader.load_model`` itself (``load_model(...)``), not a config's method."""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "load_model"
               for node in ast.walk(ast.parse(text)))


def test_a_config_becomes_a_model_in_one_place():
    """``EngineConfig.load_model`` loads for ``LLM``, the engine, the server, the verifier and ``vericache
    prefix`` (before it, one caller dropped ``--kernels`` and ``--numerics``); nothing else in the library
    calls the loader itself."""
    core = [p for p in library_files() if module_name(p).startswith("vericache.")]   # the lab's benches aside
    callers = {module_name(p) for p in core if module_name(p) != "vericache.model.loader" and calls_load_model(p.read_text())}
    assert callers == {"vericache.engine.config"}
    assert calls_load_model("m = load_model('x', kernels=k)") and not calls_load_model("m = config.load_model()")


def config_taken_apart(cls) -> list[str]:
    """Parameters of ``cls.__init__`` that carry one ``EngineConfig`` field (a config taken apart by its
    caller), and a missing whole ``config``."""
    import inspect

    from vericache.engine.config import EngineConfig

    params = inspect.signature(cls.__init__).parameters
    found = [name for name in params if name in {f.name for f in dataclasses.fields(EngineConfig)}]
    if "config" not in params:
        found.append("no config parameter")
    return found


def test_the_engines_parts_take_the_config_whole():
    """``ModelRunner``, ``StepLoop`` and ``Scheduler`` take ``EngineConfig`` whole, validated once when it
    is made (before, ``Engine`` handed them 8 and 11 of its fields and the loop validated two again); the
    check catches a part that takes a field by name."""
    from vericache.engine.runner import ModelRunner
    from vericache.engine.scheduler import Scheduler
    from vericache.engine.step_loop import StepLoop

    for part in (ModelRunner, StepLoop, Scheduler):
        assert config_taken_apart(part) == [], part.__name__

    class TakesApart:
        def __init__(self, runner, prefill_chunk: int = 512, max_running: int = 64) -> None: ...

    assert config_taken_apart(TakesApart) == ["prefill_chunk", "max_running", "no config parameter"]


CACHE_METHODS = {"parts", "attend", "layered_parts", "attention_cost"}   # what a forward asks a cache


def undeclared_caches(sources: dict[str, str]) -> list[str]:
    """Classes that answer a forward's questions (``CACHE_METHODS``) without naming a base: each must
    be declared against ``kv.protocol.KVCache`` (checked on the imported class), never found by
    ``hasattr``."""
    found = []
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name != "KVCache":
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                if methods & CACHE_METHODS and not node.bases:
                    found.append(f"{where}:{node.name}")
    return found


def cache_capability_probes(sources: dict[str, str]) -> list[str]:
    """``hasattr(x, "parts")`` / ``getattr(x, "layered_parts", ...)``: a cache's capability looked up by name."""
    found = []
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in CACHE_METHODS):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_every_cache_is_declared_against_the_kv_protocol():
    """Issue 54, item 3: one typed cache base; what a cache can do is declared, not probed."""
    import importlib

    from vericache.kv.protocol import KVCache

    sources = {str(p.relative_to(ROOT)): p.read_text() for p in library_files()}
    assert undeclared_caches(sources) == [] and cache_capability_probes(sources) == []
    declared = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and {f.name for f in node.body if isinstance(f, ast.FunctionDef)} & CACHE_METHODS:
                module = importlib.import_module(module_name(ROOT / path))
                declared.append(getattr(module, node.name))
    assert len(declared) >= 6 and all(issubclass(c, KVCache) for c in declared), declared
    # the checks find what they look for
    assert undeclared_caches({"x.py": "class C:\n    def parts(self): ...\n"}) == ["x.py:C"]
    assert cache_capability_probes({"x.py": "ok = hasattr(c, 'layered_parts')\n"}) == ["x.py:1 hasattr(c, 'layered_parts')"]


KERNEL_CONSTANTS = {"TOKEN_GROUPS", "CHANNEL_GROUPS", "FP8", "DENSE", "FORMATS", "BLOCK", "PART_INTS", "PART_TENSORS"}


def test_kernel_numbers_and_cpu_flags_are_defined_once():
    """Issue 54, item 6: the numbers the kernels are handed by position (store kinds, a part's layout, the
    GGUF formats) are assigned in ``kernels/layouts.py`` only, and /proc/cpuinfo is read in
    ``kernels/cpu.py`` only."""
    assigned, readers = [], []
    for path in library_files():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else []
            names = [e.id for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
            assigned += [f"{where}:{n}" for n in names if n in KERNEL_CONSTANTS]
        if "/proc/cpuinfo" in text and not text.startswith('"""What this CPU can run'):
            readers.append(where)
    assert sorted(assigned) == sorted(f"backend/vericache/kernels/layouts.py:{n}" for n in KERNEL_CONSTANTS)
    assert readers == []


def test_the_kernels_headers_and_the_python_layouts_agree_and_a_change_to_one_side_fails(tmp_path):
    """Issue 54, item 6: ``layouts.h``/``gguf_blocks.h`` and ``kernels/layouts.py`` agree (what every
    build checks first), and the check catches a header changed alone: a part's tensors reordered, a
    store kind renumbered, a format's block size, an implicit enum value; the packed op's arguments come
    in the layout's order."""
    import shutil

    import pytest
    import torch

    from vericache.kernels import layouts
    from vericache.kv.packed import KeyPart, op_args

    assert layouts.differences() == []
    layouts.check_headers()
    cases = [("layouts.h", "K_SCALE = 1, K_ZERO = 2", "K_ZERO = 1, K_SCALE = 2", "part tensors"),
             ("layouts.h", "FP8 = 2, DENSE = 3", "FP8 = 3, DENSE = 2", "store kinds"),
             ("gguf_blocks.h", "{4, 2, 2, 18,", "{4, 2, 2, 20,", "block bytes"),
             ("layouts.h", "EXACT = 9, PART_INTS = 10", "EXACT = 9, EXTRA = 10, PART_INTS = 11", "part ints")]
    for name, old, new, what in cases:
        folder = tmp_path / what.replace(" ", "_")
        folder.mkdir()
        for header in ("layouts.h", "gguf_blocks.h"):
            shutil.copy(layouts.HERE / header, folder / header)
        text = (folder / name).read_text()
        assert old in text, (name, old)
        (folder / name).write_text(text.replace(old, new))
        with pytest.raises(RuntimeError, match=what):
            layouts.check_headers(folder)
    with pytest.raises(ValueError, match="no explicit value"):
        layouts.header_enum("enum E { A = 0, B };", "E")
    k = torch.zeros(2, 4, 8)
    ints, tensors = op_args(3, KeyPart(k=k, v=k + 1, n=4, diag=1), 8)
    assert len(ints) == len(layouts.PART_INTS) and len(tensors) == len(layouts.PART_TENSORS)
    named = dict(zip(layouts.PART_INTS, ints))
    assert named == {"seq": 3, "n_keys": 4, "diag": 1, "k_kind": layouts.DENSE, "k_bits": 0, "k_group": 0,
                     "v_kind": layouts.DENSE, "v_bits": 0, "v_group": 0, "exact": 1}
    assert tensors[layouts.PART_TENSORS.index("v_rows")] is not None and tensors[layouts.PART_TENSORS.index("v_rows")][0, 0, 0] == 1


MODE_NAMES = {"full", "lossy", "vericache"}
MODE_HOMES = {"backend/vericache/engine/placement.py",   # the decision
              "backend/vericache/engine/options.py"}     # the modes' names, checked and labelled


def mode_comparisons(sources: dict[str, str]) -> list[str]:
    """Comparisons of something with a mode's name (``req.mode == "full"``, ``mode in ("lossy", ...)``)
    outside the modules allowed to make them."""
    found = []
    for path, text in sources.items():
        if path in MODE_HOMES:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
            if names & MODE_NAMES and any("mode" in ast.unparse(s) for s in sides):
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_a_requests_mode_is_compared_in_one_module():
    """Issue 54, item 1: where a request lives (its caches, tiers, row caches, state after prefill) is
    decided once by ``engine.placement.place``; every other module of the library asks the request's
    ``Placement`` (the lab's reports name their rows by mode, as any client may)."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in PACKAGES["vericache"].rglob("*.py")}
    assert mode_comparisons(sources) == []
    # the check finds what it looks for
    assert mode_comparisons({"x.py": "if req.mode == 'lossy':\n    pass\n"}) == ["x.py:1 req.mode == 'lossy'"]
    assert mode_comparisons({"x.py": "ok = opts.mode in ('lossy', 'vericache')\n"}) != []


def test_a_request_is_a_small_core_record_with_typed_parts():
    """Issue 54, item 4: ``Request`` is a small record (<= 14 fields) whose parts are typed (its caches,
    prefill progress, rounds, remote parts, measures); no field of it or its parts is typed ``object``."""
    import dataclasses
    import typing

    from vericache.engine import requests

    core = dataclasses.fields(requests.Request)
    assert len(core) <= 14, [f.name for f in core]
    parts = [requests.Request, requests.RequestKV, requests.PrefillProgress, requests.Drafting, requests.RemoteParts,
             requests.Measures, requests.Served]
    untyped = [f"{cls.__name__}.{name}" for cls in parts
               for name, hint in typing.get_type_hints(cls, vars(requests)).items() if hint is object]
    assert untyped == []
    assert {f.name for f in core} >= {"kv", "prefill", "drafting", "remote", "measured"}
    loose = dataclasses.make_dataclass("Loose", [("policy_state", object, None)])   # what the check catches
    assert [n for n, h in typing.get_type_hints(loose).items() if h is object] == ["policy_state"]


def flag_parameters(sources: dict[str, str], name: str = "checked") -> list[str]:
    """Functions that take a parameter called ``name``."""
    found = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                found += [f"{path}:{node.lineno} {node.name}" for a in args if a.arg == name]
    return found


def test_one_intake_one_owner_loop_one_output_type():
    """Issue 54, item 5: a request is checked and resolved once (``Engine.intake``; no ``checked`` flag
    threaded through signatures); the service and the verifier role own their engines through one
    ``EngineOwner`` (neither runs a thread or a command loop of its own); the front ends get ``EngineOutput``."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in library_files()}
    assert flag_parameters(sources) == []
    assert flag_parameters({"x.py": "def add(ids, checked=False): ...\n"}) == ["x.py:1 add"]   # the check finds it
    owners = [PACKAGES["vericache"] / "serving" / "service.py", PACKAGES["vericache"] / "remote" / "verifier.py"]
    for path in owners:
        text = path.read_text()
        assert "EngineOwner(" in text and "threading.Thread(" not in text, path   # no thread, no loop of its own
    assert not any(re.search(r"^class Delta\b", t, re.M) for t in sources.values())


def test_the_package_loads_its_public_names_on_first_use():
    """`import vericache.remote.relay` (a slow link's delay relay, started once per service) does not import
    PyTorch; `vericache.LLM` and the other public names still resolve, and an unknown one is refused."""
    import subprocess
    import sys

    code = ("import sys, vericache.remote.relay; light = 'torch' not in sys.modules; import vericache; "
            "names = [getattr(vericache, n).__name__ for n in vericache.__all__]; print(light, names)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    light, names = done.stdout.split(" ", 1)
    assert light == "True" and "LLM" in names and "resolve_model" in names, done.stdout
    import vericache
    try:
        vericache.NoSuchName   # noqa: B018
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")
