"""The house's rules, read from the code's own imports: rooms by role, public faces on top, no circle.

- `job/` holds at its top only the public surface (the package, `python -m job`, `python -m job.launch`,
  `job.multihost`, `job.sharding`, `job.task`, `job.errors`, `job.random`), the old paths of moved modules
  (each warns and names its new one) and the example tasks; the rest lives in sub-packages named for who
  reads them.
- A public module is a face: it hands on the names of the sub-package module behind it, all of them.
- No module of a sub-package imports a public module (or the `job` package) that it serves, nor an
  example task; no two modules of `job/` or `deploy/` import each other in a circle.
- The rooms stand one above another (`FLOORS`, from the ground up): a room imports only its own floor and
  those below, so a config lives in the room of the code that reads it and `TrainConfig` composes them.
- `docs/layout.md` names every module.
- A backend is a folder `deploy/NAME/` and a class in `job/runtime/cluster/NAME.py`: no other module imports
  the class or names its environment variables, and deploy/'s shared modules import no backend folder.
- An import inside a function of `job/` says why it is not at the top of its module (an entry point kept
  light, an optional dependency), in a comment on its line or the line above.
- One name, one meaning: a module basename, public function, public class or public module-level constant
  (an UPPER_CASE name) defined in more than one module of `job/` and `deploy/` is listed (`SAME_MODULE_NAMES`,
  `SAME_FUNCTION_NAMES`, `SAME_CLASS_NAMES`, `SAME_CONSTANT_NAMES`) with the one meaning it has in each; a
  constant bound to another module's value (`X = other.X`, `from other import Y as X`) is that value, not a
  second meaning.
- A test helper is defined once: what two test files need lives in `tests/launching.py` (launch runs),
  `tests/records.py` (read what they leave) or a conftest.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

from job.runtime.cluster import DETECTION_ORDER

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"job/__init__.py", "job/__main__.py", "job/launch.py", "job/multihost.py", "job/sharding.py",
          "job/task.py", "job/errors.py", "job/random.py"}
# old paths a fork may have imported, kept with a DeprecationWarning (tests/unit/test_public_api.py)
DEPRECATED = {"job/batches.py", "job/entry.py", "job/trained.py", "job/values.py"}
FACES = {"job.multihost": "job.parallel.multihost", "job.sharding": "job.parallel.sharding",
         "job.task": "job.train.task", "job.errors": "job.core.errors", "job.random": "job.train.random"}
ROLES = {"core", "kernels", "observe", "parallel", "runs", "runtime", "train"}
# the rooms from the ground up, the example tasks on top: each imports only its own floor and those below
FLOORS = ("core", "parallel", "kernels", "runtime", "runs", "observe", "train", "tasks")
# Programs written as a user writes them (each its own `loss`, `optimizer`), not test helpers.
STANDALONE = {"tests/user_tasks", "tests/scenarios"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of job/ and deploy/."""
    found = {}
    for top in ("job", "deploy"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module of this tree that the file imports, at its top or inside a function (not in a string)."""
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: from its own package
                package = name.split(".")[: -node.level]
                base = ".".join([*package, base] if base else package)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return {n for n in names if n in MODULES}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_top_of_job_holds_only_the_public_surface_the_tasks_and_the_rooms_by_role() -> None:
    top = {p.name for p in (ROOT / "job").iterdir() if p.name != "__pycache__"}
    assert top == {Path(p).name for p in PUBLIC | DEPRECATED} | ROLES | {"tasks"}, sorted(top)
    for role in ROLES:
        assert (ROOT / "job" / role / "__init__.py").read_text().startswith('"""'), f"job/{role}/ says what it holds"


@pytest.mark.parametrize("face", sorted(FACES))
def test_a_public_module_hands_on_every_public_name_of_the_module_behind_it(face: str) -> None:
    behind = FACES[face]
    tree = ast.parse(MODULES[behind].read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    public = {n for n in defined if not n.startswith("_") and n not in {"log", "T", "F"}}
    module, implementation = importlib.import_module(face), importlib.import_module(behind)
    # and the names it hands on from the modules of its own room (job.parallel.sharding: the vocabulary, the
    # rules, placement and the --mesh flag, each in its module), as its __all__ lists them
    room = behind.rpartition(".")[0] + "."
    handed_on = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                 and (node.module or "").startswith(room) for alias in node.names}
    public |= handed_on & set(getattr(implementation, "__all__", ()))
    assert set(module.__all__) == public, "the face and the module behind it name the same public names"
    for name in public:
        assert getattr(module, name) is getattr(implementation, name), name
    assert _imports(MODULES[face]) <= {behind, *_parents(behind)}, "a face imports only the module behind it"


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_no_room_imports_the_public_modules_it_serves_nor_an_example_task() -> None:
    served = {"job", "job.__main__", "job.launch", *FACES}
    wrong = {}
    for name, path in MODULES.items():
        if name.split(".")[:2][-1] in ROLES and name.startswith("job."):
            bad = {m for m in _imports(path) - set(_parents(name)) if m in served or m.startswith("job.tasks")}
            if bad:
                wrong[_rel(path)] = sorted(bad)
    assert not wrong, wrong


def _floor(name: str) -> int | None:
    """The floor of the room a module of job/ lives in (`FLOORS`); None for the top level and deploy/."""
    parts = name.split(".")
    return FLOORS.index(parts[1]) if parts[0] == "job" and len(parts) > 1 and parts[1] in FLOORS else None


def test_no_room_imports_a_room_above_it() -> None:
    assert set(FLOORS) == ROLES | {"tasks"}, "every room has its floor"
    upward = {}
    for name, path in MODULES.items():
        floor = _floor(name)
        if floor is None:
            continue
        above = sorted(m for m in _imports(path) if (_floor(m) or 0) > floor)
        if above:
            upward[_rel(path)] = above
    assert not upward, f"a room imports a room above it (FLOORS: {', '.join(FLOORS)}): {upward}"


def test_the_configs_kept_in_their_rooms_still_import_from_the_train_config() -> None:
    from job.observe.metrics import WandbConfig
    from job.runs.config import CheckpointConfig
    from job.train import config

    assert config.CheckpointConfig is CheckpointConfig
    assert config.WandbConfig is WandbConfig


def test_no_two_modules_import_each_other_in_a_circle() -> None:
    graph = {name: _imports(path) - set(_parents(name)) - {name} for name, path in MODULES.items()}
    # A package's __init__ that imports its own modules is not a circle with them: drop parent edges.
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for start in sorted(graph):
        if start not in seen:
            visit(start, [start])
    assert not circles, circles


def test_the_layout_page_names_every_module() -> None:
    page = (ROOT / "docs" / "layout.md").read_text()
    missing = []
    for path in MODULES.values():
        rel = _rel(path)
        if rel.startswith("job/tasks/"):
            continue  # the example tasks are named in their folder's row
        named = f"`{rel}`" in page or (path.name == "__init__.py" and f"`{_rel(path.parent)}/`" in page)
        if not named:
            missing.append(rel)
    assert not missing, f"docs/layout.md names no {missing}"


def _function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import inside a function (a nested function's once), in the order of their lines."""
    found = {}
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.update({node.lineno: node for node in ast.walk(function)
                          if isinstance(node, (ast.Import, ast.ImportFrom))})
    return [found[line] for line in sorted(found)]


def test_every_import_inside_a_function_says_why_it_is_not_at_the_top() -> None:
    # Imports kept in a function for one reason share the comment on the first of them: an import whose
    # nearest line above (blank lines skipped) ends an import that says why is said for too.
    unsaid = []
    for path in sorted((ROOT / "job").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        comments = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(text).readline)
                    if token.type == tokenize.COMMENT}
        said_ends: set[int] = set()
        for node in _function_imports(ast.parse(text, str(path))):
            above = node.lineno - 1
            while above and not lines[above - 1].strip():
                above -= 1
            own = any(line in comments for line in range(node.lineno, (node.end_lineno or node.lineno) + 1))
            comment_above = node.lineno - 1 in comments and lines[node.lineno - 2].lstrip().startswith("#")
            if own or comment_above or above in said_ends:
                said_ends.add(node.end_lineno or node.lineno)
            else:
                unsaid.append(f"{_rel(path)}:{node.lineno}")
    assert not unsaid, ("an import inside a function says why it is not at the top of its module (a comment "
                        f"on its line or the line above), or moves there: {unsaid}")


def test_no_test_helper_is_defined_in_two_test_files() -> None:
    # pytest_* hooks are exempt: pytest calls each conftest's own (tests/conftest.py prints each tier's time,
    # tests/container/conftest.py the container tier's figures).
    files: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if any(_rel(path).startswith(f"{folder}/") for folder in STANDALONE):
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            helper = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if helper and not node.name.startswith(("test_", "pytest_")):
                files.setdefault(node.name, []).append(_rel(path))
    twice = {name: where for name, where in files.items() if len(where) > 1}
    assert not twice, f"one definition each (tests/launching.py, tests/records.py), or another name: {twice}"


# ---------------------------------------------------------------------------------------------------- backends
# A backend is a folder deploy/NAME/ and a class of kind NAME in job/runtime/cluster/NAME.py; outside them only
# the detection order (job/runtime/cluster/__init__.py), the Makefile and the docs name it ("Adding a backend"
# in docs/layout.md). The library asks the detected class (job.runtime.cluster.environment) what it needs.
BACKENDS = tuple(dict.fromkeys(cls.kind for cls in DETECTION_ORDER))
SHARED_CLUSTER = ("job/runtime/cluster/__init__.py", "job/runtime/cluster/base.py")  # every backend's
# what a backend owns beyond its folder and its class: Slurm's node lists; the local launcher, which starts the
# processes the local class detects
OWNS = {"slurm": ("job/runtime/cluster/nodelist.py",), "local": ("job/launch.py",)}


def _room(backend: str) -> tuple[str, ...]:
    """The files (and the folder) that may name `backend`: its folder, its class's module, what it owns."""
    return (f"deploy/{backend}/", f"job/runtime/cluster/{backend}.py", *OWNS.get(backend, ()), *SHARED_CLUSTER)


def _cluster_modules(backend: str) -> set[str]:
    """`backend`'s modules in job/runtime/cluster/: its class's, and those it owns there."""
    files = [f"job/runtime/cluster/{backend}.py", *(p for p in OWNS.get(backend, ()) if "/cluster/" in p)]
    return {".".join(Path(file).with_suffix("").parts) for file in files}


def _code_strings(path: Path) -> list[str]:
    """Every string constant of a file's code (f-strings' parts included), its docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def _variables(backend: str) -> set[str]:
    """The environment variables `backend`'s class reads: its module's upper-case string constants, but for
    those another backend's module reads too (our own knobs, such as JOB_COORDINATOR_PORT)."""
    def names(kind: str) -> set[str]:
        return {s for s in _code_strings(ROOT / "job" / "runtime" / "cluster" / f"{kind}.py")
                if re.fullmatch(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+", s)}
    return names(backend) - set().union(*(names(other) for other in BACKENDS if other != backend))


def test_every_backend_is_a_deploy_folder_with_a_doctor_and_a_cluster_class_of_its_name() -> None:
    folders = {p.name for p in (ROOT / "deploy").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(BACKENDS), "each deploy/ folder is a backend, with a class of its kind in DETECTION_ORDER"
    for cls in DETECTION_ORDER:
        assert cls.__module__ == f"job.runtime.cluster.{cls.kind}", cls
    for backend in BACKENDS:
        assert (ROOT / "deploy" / backend / "doctor.py").exists(), f"deploy/{backend}/ has no doctor.py"


def test_no_module_outside_a_backends_room_imports_its_class_or_names_its_variables() -> None:
    found = []
    for backend in BACKENDS:
        own = _cluster_modules(backend)
        variables = re.compile(r"\b(%s)\b" % "|".join(sorted(_variables(backend))))
        for path in MODULES.values():
            if _rel(path).startswith(_room(backend)):
                continue
            found += [f"{_rel(path)} imports {name}" for name in sorted(_imports(path) & own)]
            found += [f"{_rel(path)} names {hit}" for text in _code_strings(path) for hit in variables.findall(text)]
    assert not found, ("ask the detected environment instead (job.runtime.cluster.environment(env) and the "
                       f"ClusterEnv classmethods; add one there if the library needs more): {found}")


def test_the_top_level_modules_of_deploy_import_no_backend_folder() -> None:
    found = [f"{_rel(path)} imports {name}" for path in sorted((ROOT / "deploy").glob("*.py"))
             for name in sorted(_imports(path)) if name.split(".")[:2] in [["deploy", b] for b in BACKENDS]]
    assert not found, ("deploy/'s top-level modules serve every backend and import no backend's folder: what one "
                       "backend alone uses belongs in its folder, what more share in a top-level module or the "
                       f"library (job.launch for the local launcher's command line): {found}")


# One name, one meaning: a module basename or a public top-level function defined in more than one module of job/
# and deploy/ is here, with the modules that define it and why they share it. A new repeat fails until it is
# listed with its reason (or renamed: two meanings get two names); a listed one that is gone fails too.
SAME_MODULE_NAMES = {
    "__init__": "a package's own module",
    "__main__": "`python -m PACKAGE`'s entry point",
    "batches": "job/batches.py is the deprecated old path of job/train/batches.py",
    "entry": "job/entry.py is the deprecated old path of job/train/entry.py",
    "errors": "job/errors.py is the public face of job/core/errors.py",
    "multihost": "job/multihost.py is the public face of job/parallel/multihost.py",
    "random": "job/random.py is the public face of job/train/random.py",
    "sharding": "job/sharding.py is the public face of job/parallel/sharding.py",
    "trained": "job/trained.py is the deprecated old path of job/train/trained.py",
    "values": "job/values.py is the deprecated old path of job/core/values.py",
    "task": "job/task.py is the public face of job/train/task.py (the Task interface); each example task's "
            "task.py is its TASK; deploy/slurm/task.py is what a Slurm task (one process of the job) runs",
    "model": "each example task's model",
    "data": "each example task's data",
    "cross_entropy": "job/tasks/lm/cross_entropy.py is the deprecated old path of job/kernels/cross_entropy.py",
    "config": "each room's typed config beside the code that reads it: the checkpointer's (job/runs), the "
              "training run's (job/train), the Cloud TPU request's (deploy/tpu)",
    "doctor": "each backend's doctor (one role: `make doctor` for that backend)",
    "wheels": "each backend's wheelhouse for its workers (one role)",
    "fit": "one subject in two layers: job/train/fit.py compiles a run's step for any devices; deploy/tpu/fit.py "
           "makes a TPU slice's compile-only devices for it and the doctor's fit line",
    "sweep": "one subject in two layers: job/runs/sweep.py plans a sweep's runs; deploy/local/sweep.py runs "
             "them with the local launcher",
}
SAME_FUNCTION_NAMES = {
    "main": "a command's entry point: `python -m MODULE`",
    "run": "run what the module is about (train, the demo, tpu-run); in each backend's doctor, the run's check",
    "parse": "text or argv into the module's typed value",
    "parse_args": "a command line into its config",
    "validate": "raise ConfigError on the first bad value of the module's config or request",
    "check": "raise the module's error where its subject is wrong (a remat policy, a resumed config, the "
             "processes' facts, Slurm options)",
    "checks": "each backend's doctor's checks (one role)",
    "devices": "each backend's devices of the job, as its doctor counts them (deploy/slurm/array.py: the count "
               "the slurm doctor asks)",
    "memory": "each backend's doctor's memory check",
    "describe": "a value as one line of text for people",
    "require": "raise ConfigError unless what is named holds",
    "resolve": "a setting as given -> the value to use",
    "problems": "what is wrong, one string each",
    "report": "findings as lines for people",
    "render": "a run's records drawn for people (a figure, a table)",
    "load": "the module's object read from where it is named (a tokenizer file, a task)",
    "loss_fn": "each example task's model's loss",
    "append": "a record as the new last line of a JSON-lines file: attempts.append is rundir.append for "
              "attempts.jsonl, numbered",
    "build_archive": "each tar the TPU workers are sent (the code, the wheelhouse)",
    "upload": "gcloud.upload is the command; wheels.upload runs it for the wheelhouse",
    "active_account": "gcloud.active_account is the command; the doctor runs it and reads the answer",
    "coordination_client": "job/core/internals.py reaches jax's private client; job/parallel/multihost.py is its "
                           "public face",
    "check_args": "ARGS parsed and validated as `python -m job train` does (the rehearsal's shrunk runs too)",
    "choose": "which of the module's candidates a model runs with, given what the run asked for (the kernel "
              "`kernels.attention` runs, the policy remat `auto` stands for)",
    "plan": "what will be made, before it is made (a sweep's runs, the train state's placement)",
    "probe": "find out by trying (a folder's writability, whether a job runs on worker 0)",
    "first_difference": "the first place two runs' values part",
    "first_failure": "the cause among an attempt's failures, per backend",
    "dry_run": "the Slurm submission printed, not made (an array of a sweep, one job)",
    "submit": "the Slurm submission (an array of a sweep, one job)",
    "wait": "follow a Slurm submission to its end (an array of a sweep, one job)",
    "duration_seconds": "a duration flag's text -> seconds, in each backend's own grammar",
    "run_dir_of": "the job's --run-dir read from its ARGS as the job's parser reads it, per backend",
    "saved_config": "the run dir's saved config, in the form each layer reads it (a dict, a TrainConfig with the "
                    "changed fields' saved values, with its task)",
    "switch": "an on/off word -> bool",
}


# Classes and module-level constants (public, UPPER_CASE) repeat the same way. A constant bound to another
# module's value is that value (`RECORD = rundir.GOODPUT` is rundir's GOODPUT): only distinct values repeat.
SAME_CLASS_NAMES = {
    "Block": "each example task's model's block",
    "ModelConfig": "each example task's model config (`Task.model_config`)",
    "DataConfig": "each example task's data config (`Task.data_config`)",
    "DoctorOptions": "each backend's doctor's own flags",
    "Failure": "an attempt's failure as each backend reads it: the process that failed first, and how",
}
SAME_CONSTANT_NAMES = {
    "T": "a type variable of the module's generic functions",
    "TASK": "each example task's Task",
    "MAX_SIZE": "the largest size each example model's config takes",
    "ARCHIVE": "the file name of the tar the module sends the TPU workers (the code's, the wheelhouse's)",
    "BUCKET_ROLE": "the IAM role a job needs on a gs:// run dir's bucket",
    "FIX": "each backend's command that makes its wheelhouse, the fix its doctor offers",
    "GENERATIONS": "the TPU generations by name, with what the module needs of each",
    "INSTALL": "the pip command that installs what the module needs",
    "KEY": "the module's prefix of its keys in jax's coordination service",
    "MAX_NAME": "the most characters of a name the module makes (a run's folder, a TPU's)",
    "PACKAGES": "the packages whose versions the module reads",
    "PER_PROCESS": "the environment variables set per process by whoever starts it, never replayed by a rerun",
    "QUICK": "each backend's doctor's quick checks, in order",
    "QUIET": "what the module sets to keep a library's start-up noise out of its output",
    "RECORD": "the run dir's file the module writes (rundir names it)",
    "ROOT": "the checkout (or image folder) the package sits in",
    "SHOWN": "the most of a long text or list an error quotes",
}
LISTED = {"module": SAME_MODULE_NAMES, "function": SAME_FUNCTION_NAMES, "class": SAME_CLASS_NAMES,
          "constant": SAME_CONSTANT_NAMES}
CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*")


def _dotted(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _bindings(tree: ast.Module, module: str, package: str) -> dict[str, tuple[str, str] | None]:
    """Each top-level name of `module` (in `package`) -> the (module, name) it is bound to: an import's, or the
    value of another name assigned to it (`X = other.Y`, `X = Y`); None for a value of its own."""
    modules: dict[str, str] = {}  # a name bound to a module: `import a.b as m`, `from a import b` (a module or not)
    bound: dict[str, tuple[str, str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            modules.update({alias.asname: alias.name for alias in node.names if alias.asname})
            modules.update({alias.name.split(".")[0]: alias.name.split(".")[0] for alias in node.names
                            if not alias.asname})
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*parts, node.module] if node.module else parts)
            for alias in node.names:
                bound[alias.asname or alias.name] = (base, alias.name)
                modules[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            value, to = node.value, None
            if isinstance(value, ast.Name) and value.id in bound:
                to = bound[value.id] or (module, value.id)
            elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id in modules:
                to = (modules[value.value.id], value.attr)
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names = [target] if isinstance(target, ast.Name) else getattr(target, "elts", [])
                bound.update({name.id: to for name in names if isinstance(name, ast.Name)})
    return bound


def _definitions(root: Path = ROOT) -> dict[str, dict[str, dict[str, list[str]]]]:
    """Kind (module, function, class, constant) -> name -> meaning -> the files of root's job/ and deploy/ that
    define the name with it. A module basename, a public function or class means what its file says (one meaning
    a file); a public constant means the value it is bound to, followed through imports and `X = other.Y`."""
    found: dict[str, dict[str, dict[str, list[str]]]] = {kind: {} for kind in LISTED}
    trees = {path: ast.parse(path.read_text(encoding="utf-8"))
             for path in sorted([*root.glob("job/**/*.py"), *root.glob("deploy/**/*.py")])}
    bindings = {}
    for path, tree in trees.items():
        module = _dotted(root, path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        bindings[module] = _bindings(tree, module, package)

    def origin(module: str, name: str) -> str:
        seen = set()
        while (module, name) not in seen and bindings.get(module, {}).get(name) is not None:
            seen.add((module, name))
            module, name = bindings[module][name]  # type: ignore[misc]
        return f"{module}.{name}"

    def add(kind: str, name: str, meaning: str, relative: str) -> None:
        where = found[kind].setdefault(name, {}).setdefault(meaning, [])
        if relative not in where:  # a name defined twice in one module (under `if`) is one name
            where.append(relative)

    for path, tree in trees.items():
        relative, module = str(path.relative_to(root)), _dotted(root, path)
        add("module", path.stem, relative, relative)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                add("function", node.name, relative, relative)
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                add("class", node.name, relative, relative)
        for name in bindings[module]:
            if CONSTANT.fullmatch(name):
                add("constant", name, origin(module, name), relative)
    return found


def _unlisted(found: dict[str, dict[str, dict[str, list[str]]]],
              listed: dict[str, dict[str, str]]) -> tuple[list[str], list[str]]:
    """(each name of more than one meaning that `listed` does not name, with its files; each listed name that
    has one meaning or none)."""
    new, stale = [], []
    for kind, names in found.items():
        repeated = {name for name, meanings in names.items() if len(meanings) > 1}
        new += [f"{kind} {name}: {sorted(f for files in names[name].values() for f in files)}"
                for name in sorted(repeated - set(listed[kind]))]
        stale += [f"{kind} {name}" for name in sorted(set(listed[kind]) - repeated)]
    return new, stale


def _check_one_meaning(root: Path, listed: dict[str, dict[str, str]]) -> None:
    new, stale = _unlisted(_definitions(root), listed)
    assert not new, ("a name defined in more than one module of job/ and deploy/: rename one where the two mean "
                     "different things, or list it in SAME_MODULE_NAMES / SAME_FUNCTION_NAMES / SAME_CLASS_NAMES / "
                     "SAME_CONSTANT_NAMES with the one meaning it has: " + "; ".join(new))
    assert not stale, f"listed as repeated, found once or not at all (take them off the list): {stale}"
    assert all(reason for names in listed.values() for reason in names.values())


def test_a_module_function_class_or_constant_name_repeats_only_where_listed_with_its_one_meaning() -> None:
    _check_one_meaning(ROOT, LISTED)


def test_the_one_meaning_check_fails_on_a_repeated_class_or_constant_but_not_on_an_alias(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "__init__.py").write_text("")
    (tmp_path / "job" / "a.py").write_text("class Plan:\n    pass\n\n\nSHARE = 0.9\nNAMES = ('a', 'b')\n")
    (tmp_path / "job" / "b.py").write_text("from job import a\nfrom job.a import NAMES as KNOWN\n\n"
                                           "SHARE = 2.0\nNAMES = a.NAMES\n")
    (tmp_path / "job" / "c.py").write_text("from .a import NAMES\n\n\nclass Plan:\n    pass\n\n\n"
                                           "KNOWN = NAMES\n")
    none: dict[str, dict[str, str]] = {kind: {} for kind in LISTED}
    new, _ = _unlisted(_definitions(tmp_path), none)
    # NAMES and KNOWN are a's NAMES wherever they are bound (an import, an alias): one meaning each
    assert new == ["class Plan: ['job/a.py', 'job/c.py']", "constant SHARE: ['job/a.py', 'job/b.py']"]
    with pytest.raises(AssertionError, match="class Plan: .*constant SHARE"):
        _check_one_meaning(tmp_path, none)
    listed = {**none, "class": {"Plan": "a plan"}, "constant": {"SHARE": "a share", "NAMES": "names"}}
    with pytest.raises(AssertionError, match=r"found once or not at all .*\['constant NAMES'\]"):
        _check_one_meaning(tmp_path, listed)
    del listed["constant"]["NAMES"]
    _check_one_meaning(tmp_path, listed)
    (tmp_path / "job" / "c.py").write_text("from .a import NAMES\n\n\nKNOWN = ('a',)\n")  # KNOWN: a new value
    assert _unlisted(_definitions(tmp_path), listed)[0] == ["constant KNOWN: ['job/b.py', 'job/c.py']"]
