#!/usr/bin/env python3
"""Move ``crashproof.checkpoint``'s flat modules into subpackages by flow.

Run from the repository root, on a committed tree (the move is one ``git diff`` to review)::

    python tools/move_checkpoint.py            # --dry-run: print what would change, change nothing
    ruff check --fix src tests benchmarks examples && ruff format src tests benchmarks examples
    mypy && lint-imports && pytest

1. ``git mv`` each module of :data:`MOVES` to its new home (a module this tree lacks is skipped).
   Modules not listed (``manager.py`` and its collaborators, ``_group.py``) stay at the top of
   ``checkpoint/``: only their imports change.
2. Rewrites every file under ``src/``, ``tests/``, ``benchmarks/``, ``examples/``, ``docs/`` and
   ``README.md`` (tracked, or new and not ignored: whatever exists when it runs, so modules added
   by other work are covered too):

   - ``from crashproof.checkpoint._old import a, b``: each name is imported from where it is
     defined (re-exports followed). Outside the name's subpackage, in ``src/``, ``docs/``,
     ``examples/`` and ``README.md``, from the subpackage itself (``crashproof.checkpoint.save``:
     the ``private_modules`` contract); inside it, and in ``tests/`` and ``benchmarks/`` (which use
     private names and patch modules), from the private module's new path.
   - ``from crashproof.checkpoint import _old``: the module from its subpackage, under its new
     name (a renamed module's uses in that file are renamed with it).
   - Any other mention: dotted (``"crashproof.checkpoint._lock._EXITING_WAIT_S"``, ``:mod:``
     references, ``import crashproof.checkpoint._old``), as a path (``checkpoint/_old.py``), relative
     (``:mod:`._old``` in a checkpoint module) or a bare ````_old```` in a checkpoint module.
3. Writes each subpackage's ``__init__``: its docstring (:data:`SUBPACKAGES`) and every name that
   the rewritten imports of step 2 take from it, imported from its module, in ``__all__``.

Finally it lists any mention of an old module left (to fix by hand) and any import it could not
make public (a private name, or a module object, imported across subpackages in ``src/``).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "crashproof.checkpoint"
PACKAGE_DIR = Path("src/crashproof/checkpoint")
SCOPE = ("src", "tests", "benchmarks", "examples", "docs", "README.md")
PRIVATE_IMPORTERS = ("tests/", "benchmarks/")
"""Files that import private modules by their path (they use private names and patch modules)."""

SUBPACKAGES = {
    "format": (
        "The on-disk format: the names in a root, the manifest, each rank's index and tensor file,\n"
        "the state tree as JSON, checksums, dtypes, and the limits on what is read (and on the\n"
        "metadata a caller passes). Saving and restoring both build on it; it knows neither."
    ),
    "save": (
        "The save pipeline: the snapshot (into reusable staging buffers), delta encoding, the\n"
        "check that what is saved is finite, persist and commit; and the counters of saves."
    ),
    "restore": (
        "Reading checkpoints back: the manifest and the ranks' indexes, a rank's tensors and state\n"
        "verified (the same path as ``crashproof verify``), sharded (DTensor) state through\n"
        "``torch.distributed.checkpoint``, and which saved rank a new rank restores when the world\n"
        "size changed."
    ),
    "root": (
        "A checkpoint root: its one writer's lock, what is in it (the committed checkpoints, what\n"
        "``crashproof ls`` lists, the retention and prune plans) and its rollback marks."
    ),
    "tiers": (
        "Durable tiers: committed checkpoints replicated to remote storage, in the trainer's\n"
        "process or by the agent of ``crashproof run``; whole checkpoints copied between storages."
    ),
    "export": (
        "Export to standard formats (safetensors, ``torch.distributed.checkpoint``), and where an\n"
        "export may write."
    ),
}

MOVES = {
    # format/: what is on disk
    "_names": "format._names",
    "_fields": "format._fields",
    "_format": "format._manifest",
    "_rank_index": "format._rank_index",
    "_pieces": "format._pieces",
    "_shard": "format._shard_file",  # writes and reads one rank's tensor file
    "_tree": "format._state_tree",
    "_hashing": "format._hashing",
    "_dtypes": "format._dtypes",
    "_metadata": "format._user_metadata",  # the caller's save(metadata=), checked
    # save/
    "_writer": "save._writer",
    "_staging": "save._staging",
    "_delta": "save._delta",
    "_finite": "save._finite",
    "_stats": "save._stats",
    # restore/
    "_read_manifest": "restore._read_manifest",
    "_reader": "restore._rank_read",
    "_sharded": "restore._dcp_reader",  # torch.distributed.checkpoint's reader for DTensor state
    "_reshard": "restore._rank_mapping",  # which saved rank a new rank restores
    # root/: one checkpoint root
    "_lock": "root._lock",
    "_lock_file": "root._lock_file",
    "_lock_holder": "root._lock_holder",
    "_catalog": "root._catalog",
    "_listing": "root._listing",
    "_rollbacks": "root._rollbacks",
    # tiers/
    "_tier": "tiers._tier",
    "_backlog": "tiers._backlog",
    "_replication": "tiers._replicator",
    "_hosted": "tiers._agent_replication",
    "_transfer": "tiers._transfer",
    # export/
    "_export": "export._export",
    "_export_target": "export._target",
}

OLD = {f"{PACKAGE}.{old}": f"{PACKAGE}.{new}" for old, new in MOVES.items()}
"""Old dotted module -> new dotted module."""
NEW = {new: old for old, new in OLD.items()}


def sub_of(module: str) -> str | None:
    """The subpackage of a (new) dotted module of the package, or None at its top."""
    parts = module.removeprefix(PACKAGE + ".").split(".")
    return parts[0] if len(parts) == 2 and parts[0] in SUBPACKAGES else None


def file_of(module: str) -> Path:
    """The source file of a (new) dotted module."""
    return Path("src", *module.split(".")).with_suffix(".py")


def module_of(path: Path) -> str | None:
    """The dotted module a file under src/ is, or None."""
    if path.parts[0] != "src" or path.suffix != ".py":
        return None
    parts = list(path.with_suffix("").parts[1:])
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# -- where a name lives ---------------------------------------------------------------------------


class Resolver:
    """Where each name of a checkpoint module is defined, re-exports followed (parsed after the
    move, so the files are read at their new paths; import statements still name old modules)."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[set[str], dict[str, tuple[str, str]]]] = {}

    def _parse(self, module: str) -> tuple[set[str], dict[str, tuple[str, str]]]:
        if module not in self._parsed:
            defined: set[str] = set()
            imported: dict[str, tuple[str, str]] = {}
            path = file_of(OLD.get(module, module))
            tree = ast.parse(path.read_text()) if path.exists() else ast.Module([], [])
            for node in _top_level(tree.body):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    defined.add(node.name)
                elif isinstance(node, ast.Assign):
                    defined.update(_target_names(node.targets))
                elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                    defined.update(_target_names([node.target]))
                elif isinstance(node, ast.ImportFrom):
                    source = _absolute(node, module, is_package=False)
                    for alias in node.names:
                        imported[alias.asname or alias.name] = (source, alias.name)
                elif isinstance(node, ast.Import):
                    defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            self._parsed[module] = (defined, imported)
        return self._parsed[module]

    def home(self, module: str, name: str) -> tuple[str, str]:
        """``(new dotted module, name there)`` of ``name`` as imported from old ``module``."""
        seen: set[tuple[str, str]] = set()
        while (module, name) not in seen:
            seen.add((module, name))
            defined, imported = self._parse(module)
            if name in defined or name not in imported:
                break
            source, original = imported[name]
            if not source.startswith(PACKAGE + "._"):
                break  # from outside the package (errors, storage, ...): it is imported here
            module, name = source, original
        return OLD.get(module, module), name


def _top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    for node in body:
        yield node
        if isinstance(node, ast.Try | ast.If):  # `try: import fcntl`, `if TYPE_CHECKING:`
            yield from _top_level(node.body)
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)


def _target_names(targets: list[ast.expr]) -> set[str]:
    names: set[str] = set()
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)
    return names


def _absolute(node: ast.ImportFrom, module: str | None, *, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names (relative ones resolved from ``module``)."""
    if not node.level:
        return node.module or ""
    if module is None:
        raise SystemExit(f"a relative import outside src/: from {'.' * node.level}{node.module}")
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


# -- rewriting imports ----------------------------------------------------------------------------


@dataclass
class Report:
    exports: dict[str, dict[str, str]] = field(default_factory=lambda: {s: {} for s in SUBPACKAGES})
    """Subpackage -> exported name -> the module it is imported from."""
    warnings: list[str] = field(default_factory=list)
    changed: set[Path] = field(default_factory=set)


def _import_lines(groups: dict[str, list[tuple[str, str]]], indent: str) -> list[str]:
    """One ``from module import name as local, ...`` per module."""
    return [
        f"{indent}from {module} import "
        + ", ".join(n if n == local else f"{n} as {local}" for n, local in names)
        for module, names in groups.items()
    ]


def target_for(importer: Path, home: str, name: str, report: Report, what: str) -> str:
    """The module an importer at ``importer`` (its path after the move) imports ``name`` from,
    ``home`` being where it is defined; records the subpackage's export."""
    sub = sub_of(home)
    if sub is None or name == "*":
        return home
    inside = importer.parent == PACKAGE_DIR / sub
    if inside or str(importer).startswith(PRIVATE_IMPORTERS):
        return home
    if name.startswith("_"):
        if importer.parts[0] == "src":
            report.warnings.append(f"{importer}: imports the private {name} from {home} ({what})")
        return home
    report.exports[sub][name] = home
    return f"{PACKAGE}.{sub}"


def rewrite_python(path: Path, text: str, resolver: Resolver, report: Report) -> str:
    """``text`` with every ``from ... import`` of a moved module pointed at the names' homes."""
    tree = ast.parse(text)
    module = module_of(path)
    module = NEW.get(module or "", module)  # a moved file's relative imports were written there
    is_package = path.name == "__init__.py"
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    renamed: dict[str, str] = {}  # module objects imported under a name that changes
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = _absolute(node, module, is_package=is_package)
        groups: dict[str, list[tuple[str, str]]] = {}
        if source in OLD:
            for alias in node.names:
                home, name = resolver.home(source, alias.name)
                where = target_for(path, home, name, report, f"from {source}")
                groups.setdefault(where, []).append((name, alias.asname or alias.name))
        elif source == PACKAGE and any(f"{PACKAGE}.{a.name}" in OLD for a in node.names):
            for alias in node.names:
                new = OLD.get(f"{PACKAGE}.{alias.name}")
                if new is None:
                    groups.setdefault(PACKAGE, []).append((alias.name, alias.asname or alias.name))
                    continue
                parent, _, base = new.rpartition(".")
                if path.parts[0] == "src" and path.parent != file_of(new).parent:
                    report.warnings.append(f"{path}: imports the module {new} itself")
                if alias.asname is None and base != alias.name:
                    renamed[alias.name] = base
                groups.setdefault(parent, []).append((base, alias.asname or base))
        elif node.level and module in NEW.values():  # a moved file's relative import: absolute
            groups[source] = [(a.name, a.asname or a.name) for a in node.names]
        else:
            continue
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        prefix = lines[first][: node.col_offset]
        span = "".join(lines[first : last + 1])
        if prefix.strip() or "#" in span[node.col_offset :] or ";" in span:
            report.warnings.append(f"{path}:{node.lineno}: import not rewritten (comment or ;)")
            continue
        edits.append((first, last, [line + "\n" for line in _import_lines(groups, prefix)]))
    for first, last, new_lines in sorted(edits, reverse=True):
        lines[first : last + 1] = new_lines
    text = "".join(lines)
    for old, new in renamed.items():
        text = rename_name(text, old, new)
    return text


def rename_name(text: str, old: str, new: str) -> str:
    """Every use of the variable ``old`` renamed ``new`` (attributes, strings untouched)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    lines = text.splitlines(keepends=True)
    previous = None
    spots = []
    for token in tokens:
        if token.type == tokenize.NAME and token.string == old and previous != ".":
            spots.append(token.start)
        if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous = token.string
    for row, col in reversed(spots):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    return "".join(lines)


IMPORT_LINE = re.compile(
    r"^(?P<indent>[ \t>]*)from (?P<module>crashproof\.checkpoint\._\w+) import "
    r"(?P<names>[\w, ]+?)[ \t]*$",
    re.M,
)


def rewrite_other(path: Path, text: str, resolver: Resolver, report: Report) -> str:
    """One-line ``from ... import`` statements in a non-Python file (docs' examples)."""

    def replace(match: re.Match[str]) -> str:
        source = match["module"]
        if source not in OLD:
            return match[0]
        groups: dict[str, list[tuple[str, str]]] = {}
        for item in match["names"].split(","):
            requested, _, local = item.strip().partition(" as ")
            home, name = resolver.home(source, requested)
            where = target_for(path, home, name, report, f"from {source}")
            groups.setdefault(where, []).append((name, local or requested))
        return "\n".join(_import_lines(groups, match["indent"]))

    return IMPORT_LINE.sub(replace, text)


def _alternation(names: Iterable[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


def rewrite_mentions(path: Path, text: str, resolver: Resolver, report: Report) -> str:
    """Dotted names, paths, relative and bare mentions of the moved modules. A dotted name in a
    user's page (docs, examples, README) names the subpackage where it exports the name."""
    olds = _alternation(MOVES)
    public = not str(path).startswith(("src/", *PRIVATE_IMPORTERS))

    def dotted(match: re.Match[str]) -> str:
        source, attribute = f"{PACKAGE}.{match[1]}", match[2]
        if attribute is None:
            return OLD[source]
        home, name = resolver.home(source, attribute)
        if public and name == attribute and not name.startswith("_"):
            where = target_for(path, home, name, report, f"{source}.{attribute}")
            return f"{where}.{name}"
        return f"{OLD[source]}.{attribute}"

    text = re.sub(rf"\b{re.escape(PACKAGE)}\.({olds})\b(?:\.(\w+))?", dotted, text)
    text = re.sub(
        rf"\bcheckpoint/({olds})\.py\b",
        lambda m: "checkpoint/" + MOVES[m[1]].replace(".", "/") + ".py",
        text,
    )
    if path.is_relative_to(PACKAGE_DIR):
        # Sphinx references relative to the module: absolute now (the module moved, or the one
        # it names did; a moved module's references to those that stay are absolute too).
        named = [*MOVES]
        if path.parent != PACKAGE_DIR:
            named += [p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__"]
        text = re.sub(
            rf"(`~?)\.({_alternation(named)})(?=[`.])",
            lambda m: m[1] + OLD.get(f"{PACKAGE}.{m[2]}", f"{PACKAGE}.{m[2]}"),
            text,
        )
        text = re.sub(
            rf"``({olds})``",
            lambda m: "``" + MOVES[m[1]].rpartition(".")[2] + "``",
            text,
        )
    return text


LEFTOVER = re.compile(
    rf"\b{re.escape(PACKAGE)}\.({_alternation(MOVES)})\b|\bcheckpoint/({_alternation(MOVES)})\.py\b"
    rf"|(?:from {re.escape(PACKAGE)} import [^\n]*\b({_alternation(MOVES)})\b)"
)


# -- the move ---------------------------------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def text_files() -> Iterable[tuple[Path, str]]:
    """Every text file in scope, with its text: tracked, or new and not ignored."""
    listed = git("ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *SCOPE)
    for path in sorted({Path(p) for p in listed.split("\0") if p and Path(p).is_file()}):
        try:
            yield path, path.read_text()
        except UnicodeDecodeError:
            continue


def init_text(sub: str, exports: dict[str, str]) -> str:
    by_module: dict[str, list[str]] = {}
    for name, module in sorted(exports.items()):
        by_module.setdefault(module, []).append(name)
    imports = "".join(
        f"from {module} import {', '.join(names)}\n" for module, names in sorted(by_module.items())
    )
    listed = "".join(f'    "{name}",\n' for name in sorted(exports))
    return (
        f'"""{SUBPACKAGES[sub]}\n"""\n\nfrom __future__ import annotations\n\n'
        f"{imports}\n__all__ = [\n{listed}]\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    args = parser.parse_args(argv)
    if not (PACKAGE_DIR / "__init__.py").is_file():
        sys.exit(f"run from the repository root: no {PACKAGE_DIR}/__init__.py here")
    applied = [s for s in SUBPACKAGES if (PACKAGE_DIR / s).exists()]
    if applied:
        sys.exit(f"already moved: {', '.join(applied)} exist under {PACKAGE_DIR}")

    moves = []
    for old, new in MOVES.items():
        source, target = PACKAGE_DIR / f"{old}.py", file_of(f"{PACKAGE}.{new}")
        if source.exists():
            moves.append((source, target))
        else:
            print(f"skipped (not in this tree): {source}")
    if args.dry_run:
        for source, target in moves:
            print(f"git mv {source} {target}")
        return 0
    for sub in SUBPACKAGES:
        (PACKAGE_DIR / sub).mkdir()
    for source, target in moves:
        git("mv", str(source), str(target))

    resolver, report = Resolver(), Report()
    for path, text in text_files():
        if not path.is_relative_to(PACKAGE_DIR) and not re.search(r"\bcheckpoint[./]", text):
            continue
        if path.suffix == ".py":
            new = rewrite_python(path, text, resolver, report)
        else:
            new = rewrite_other(path, text, resolver, report)
        new = rewrite_mentions(path, new, resolver, report)
        if new != text:
            path.write_text(new)
            report.changed.add(path)

    for sub, exports in report.exports.items():
        init = PACKAGE_DIR / sub / "__init__.py"
        init.write_text(init_text(sub, exports))
        git("add", str(init))

    print(f"moved {len(moves)} modules; rewrote {len(report.changed)} files")
    for sub, exports in report.exports.items():
        print(f"  {PACKAGE}.{sub}: exports {len(exports)} names")
    leftovers = [
        f"{path}:{number}: {line.strip()}"
        for path, text in text_files()
        for number, line in enumerate(text.splitlines(), 1)
        if LEFTOVER.search(line)
    ]
    for line in [*report.warnings, *(f"old name left: {x}" for x in leftovers)]:
        print(f"warning: {line}")
    print("next: ruff check --fix, ruff format, mypy, lint-imports, pytest")
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
