"""The README and every page of the manual (docs/**/*.md, the mkdocs site) cannot drift from the code: the settings,
paths, classes, commands and links they name are checked against the repository, each problem reported as
``file:line: what``.

- **Config keys**: ``--model.x`` / ``--data.x`` / ``--trainer.x`` on any command line or in inline code; the
  dotted key that opens an inline code span (``data.sampling.group_size: 16``, with the keys of its YAML value)
  or sits in a table's first column (``model.objective.epsilon_low`` / ``epsilon_high``: siblings); dotted keys in
  code comments; every key of a YAML block under ``model:`` / ``data:`` / ``trainer:``. A key resolves against
  ``GRPOModule`` / ``RolloutDataModule`` / ``Trainer`` (``SFTModule`` / ``SFTDataModule`` for
  ``grpo_lightning sft`` commands and under a heading about SFT) and on through the classes their type hints name
  (``ObjectiveConfig``, ``SamplingConfig``, ...). A key under ``init_args`` belongs to the class its
  ``class_path`` names: the YAML block's own, or a ``--config`` file's on the same command line; else any
  subclass of the setting's type must have it. Resolved from signatures, not by the CLI parser, which imports
  and builds classes and takes seconds per command line.
- **Commands**: ``grpo_lightning``'s subcommand and its other flags; a ``tools/`` script's ``--flags`` (its
  argparse must define each); a command that composes a config whose header's commands all pass some override
  (``configs/lora.yaml``: ``--model.lr``; a strategy preset: ``--trainer.devices``) passes it too; no
  ``pip install 'grpo_lightning[x]'`` (a checkout installs ``-e ".[x]"``), and each extra exists.
- **Paths** under ``configs/``, ``tools/``, ``docs/``, ``tests/``, ``grpo_lightning/``, ``.ci/`` (and
  ``rollout/round.py``-style paths inside ``grpo_lightning/``) in code and link targets; every ``grpo_lightning.x.Name``
  and every importable ``class_path`` imports; every relative link's file and ``#anchor`` exist: on a docs page
  the anchors are mkdocs' (``toc``'s slugify, checked against Python-Markdown's own rendering), in the README
  GitHub's; a docs page links only to pages and files inside docs/ (the site has nothing else: a repository file
  is named as code, ``configs/quickstart.yaml``, and checked as a path).
- **The site**: every docs page is in ``mkdocs.yml``'s nav and every nav entry exists; the README stays within
  ``README_MAX_LINES`` (the manual is the site; ``mkdocs build --strict`` in CI checks the rest, not this suite).
- **docs/coming_from_trl.md** has a row for each field of TRL's ``GRPOConfig`` and none for a field it lacks.

``test_the_checker_finds_and_flags`` runs the extractor on a small made-up document: it must find a known key
and flag a fake one of every kind, so a checker that silently finds nothing fails too.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
import shlex
import typing
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import load_tool

from grpo_lightning.renamed_keys import respell

ROOT = Path(__file__).resolve().parents[2]
TRL_DOC = "docs/coming_from_trl.md"

# Keys that README rows describe before their code lands (other work in progress). Empty it once they exist:
# the test then checks them like every other key.
PENDING_KEYS: set[str] = set()

# Inline code that starts like a config key but is a Python attribute (a callback's view of the Trainer).
NOT_KEYS = {"trainer.datamodule.last_rollout"}

SECTIONS = ("model", "data", "trainer")
TOP_LEVEL = {"seed_everything", "ckpt_path"}  # keys of a config file beside the three sections
CLI_FLAGS = {"config", "ckpt_path", "print_config", "seed_everything", "help"}
SUBCOMMANDS = {"fit", "validate", "test", "predict"}
PATH_ROOTS = ("configs", "tools", "docs", "tests", "grpo_lightning", r"\.ci")
SUBPACKAGES = ("rollout", "callbacks", "engines", "environments", "models", "rewards", "losses", "tasks")

KEY = r"(?:model|data|trainer)(?:\.[a-z_]\w*)+"
FLAG_KEY_RE = re.compile(rf"(?<![\w-])--({KEY})")
COMMENT_KEY_RE = re.compile(rf"(?<![\w./-])(?:--)?({KEY})")
PATH_RE = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(PATH_ROOTS)})/[\w.{{}},*/-]*)")
SUBPACKAGE_PATH_RE = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(SUBPACKAGES)})/[\w/]*\w\.py)\b")
CLASS_RE = re.compile(r"(?<![\w./-])(grpo_lightning(?:\.[A-Za-z_]\w*)+)")
SPAN_RE = re.compile(r"(?<!`)`([^`]+)`(?!`)", re.S)
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^\s*```\s*([\w-]*)")


SETTINGS_PAGE = "docs/reference/settings.md"  # written at build time by a hook: in the tree it may be a stub
README_MAX_LINES = 300


def _docs_pages() -> list[str]:
    """Every page of the site (docs/**/*.md), the settings page left out only while it is a stub with no key."""
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    stub = (ROOT / SETTINGS_PAGE).is_file() and not re.search(KEY, (ROOT / SETTINGS_PAGE).read_text())
    return [p for p in pages if not (p == SETTINGS_PAGE and stub)]


DOCS = ["README.md", *_docs_pages()]


@dataclass
class Found:
    """What the extractor saw in one document: each item with its ``file:line``."""

    keys: list[tuple[str, tuple, bool, dict]] = field(default_factory=list)  # where, segments, sft, class_paths
    params: list[tuple[str, str, str]] = field(default_factory=list)  # where, class path, parameter
    paths: list[tuple[str, str]] = field(default_factory=list)
    classes: list[tuple[str, str]] = field(default_factory=list)
    links: list[tuple[str, str, str]] = field(default_factory=list)  # where, document, target
    problems: list[str] = field(default_factory=list)  # found while reading (bad flags, commands, YAML)
    commands: list[tuple[str, list[str], list[str]]] = field(default_factory=list)  # where, configs, keys
    anchors: set[str] = field(default_factory=set)  # of the document itself


# ------------------------------------------------------------------------------------------- reading markdown
def _lines_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset)


def scan(name: str, text: str) -> Found:
    """Everything ``name`` (a markdown document) says that can be checked, with where it says it."""
    found = Found(anchors=anchors_of(text, github=not name.startswith("docs/")))
    lines = text.splitlines()
    heading, fence, block, block_start = "", None, [], 0
    prose: list[tuple[int, str]] = []  # a paragraph's lines, with their numbers

    def flush_prose() -> None:
        if prose:
            first, chunk = prose[0][0], "\n".join(line for _, line in prose)
            _scan_prose(found, name, first, chunk, _is_sft(heading))
            prose.clear()

    for number, line in enumerate(lines, start=1):
        if fence is not None:
            if re.match(r"^\s*```\s*$", line):
                _scan_block(found, name, block_start, fence, block, _is_sft(heading))
                fence = None
            else:
                block.append(line)
            continue
        match = FENCE_RE.match(line)
        if match:
            flush_prose()
            fence, block, block_start = match.group(1).lower(), [], number + 1
            continue
        if line.startswith("#"):
            flush_prose()
            heading = line
            _scan_prose(found, name, number, line, False, keys=False)
        elif line.lstrip().startswith("|"):
            flush_prose()
            _scan_table_row(found, name, number, line, _is_sft(heading))
        elif line.strip():
            prose.append((number, line))
        else:
            flush_prose()
    flush_prose()
    return found


def _is_sft(heading: str) -> bool:
    return bool(re.search(r"\bSFT\b", heading))


def _spans(text: str) -> Iterator[tuple[int, str]]:
    """Inline code spans (``\\|`` in a table cell is a ``|``), with the line offset where each starts."""
    for match in SPAN_RE.finditer(text):
        yield _lines_of(text, match.start()), match.group(1).replace("\\|", "|")


def _scan_prose(found: Found, name: str, first: int, text: str, sft: bool, keys: bool = True) -> None:
    for target_match in LINK_RE.finditer(text):
        target = target_match.group(1)
        found.links.append((f"{name}:{first + _lines_of(text, target_match.start())}", name, target))
        _scan_code(found, f"{name}:{first + _lines_of(text, target_match.start())}", target.split("#")[0])
    for offset, span in _spans(text):
        where = f"{name}:{first + offset}"
        _scan_code(found, where, span)
        if keys:
            _scan_span_keys(found, where, span, sft)


def _scan_table_row(found: Found, name: str, number: int, line: str, sft: bool) -> None:
    """A table row: its spans as prose; in its first cell, keys also with their siblings (``a.b.c`` / ``d``) and a
    class path with its parameters (``grpo_lightning.callbacks.KLController`` (``target_kl``, ``horizon``))."""
    where = f"{name}:{number}"
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    if not cells:
        return
    _scan_prose(found, name, number, line, sft)
    previous_key, previous_class = None, None
    for _, span in _spans(cells[0]):
        if re.fullmatch(KEY, span):
            previous_key, previous_class = span, None  # already checked as a span
        elif re.fullmatch(r"grpo_lightning(?:\.\w+)+", span):
            previous_key, previous_class = None, span
        elif re.fullmatch(r"[a-z_]\w*", span):
            if previous_key:
                sibling = previous_key.rsplit(".", 1)[0] + "." + span
                found.keys.append((where, tuple(sibling.split(".")), sft, {}))
            elif previous_class:
                found.params.append((where, previous_class, span))


def _scan_span_keys(found: Found, where: str, span: str, sft: bool) -> None:
    """Keys in one inline code span: ``--x.y`` flags (as a command fragment), and a key that opens the span, with
    the keys of its YAML value (``data.rewards: [{name: f, weight: 1}]``)."""
    if FLAG_KEY_RE.search(span) or re.search(r"(?<![\w-])--config\b", span):
        _scan_command_tokens(found, where, _split(span), sft, full=False)
        return
    match = re.match(rf"({KEY})(\s*:\s*(.*))?$", span.strip(), re.S)
    if not match or match.group(1) in NOT_KEYS:
        return
    segments = tuple(match.group(1).split("."))
    found.keys.append((where, segments, sft, {}))
    if match.group(3):
        try:
            node = yaml.compose(match.group(3))
        except yaml.YAMLError:
            return  # prose shorthand (``{r: 16, ...}``), not YAML
        _walk_yaml(found, where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1]) - 1, node, segments, sft, {})


def _scan_code(found: Found, where: str, text: str) -> None:
    """Repository paths and ``grpo_lightning.x.Name`` class paths anywhere in a piece of code."""
    for match in PATH_RE.finditer(text):
        found.paths.append((where, match.group(1).rstrip(".,:;")))
    for match in SUBPACKAGE_PATH_RE.finditer(text):
        found.paths.append((where, "grpo_lightning/" + match.group(1)))
    for match in CLASS_RE.finditer(text):
        found.classes.append((where, match.group(1)))


def _scan_block(found: Found, name: str, start: int, lang: str, block: list[str], sft: bool) -> None:
    for offset, line in enumerate(block):
        _scan_code(found, f"{name}:{start + offset}", line)
    if lang in ("yaml", "yml"):
        _scan_yaml_block(found, name, start, "\n".join(block), sft)
        comments = [line.split("#", 1)[1] if "#" in line else "" for line in block]
    elif lang == "python":
        comments = [line.split("#", 1)[1] if "#" in line else "" for line in block]
    else:  # bash, console, plain: commands, and keys in comments (plain text: everywhere)
        _scan_commands(found, name, start, block, sft)
        comments = [_comment(line) if lang in ("bash", "sh", "shell", "console") else line for line in block]
    for offset, comment in enumerate(comments):
        for match in COMMENT_KEY_RE.finditer(comment):
            if match.group(1) not in NOT_KEYS:
                found.keys.append((f"{name}:{start + offset}", tuple(match.group(1).split(".")), sft, {}))


def _comment(line: str) -> str:
    """The comment of a shell line (after a ``#`` that starts a word outside quotes), or an empty string."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[i + 1 :]
    return ""


def _split(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # unbalanced quotes in prose-like code
        return command.split()


def _scan_commands(found: Found, name: str, start: int, block: list[str], sft: bool) -> None:
    """Each ``grpo_lightning`` or ``tools/`` command of a shell block (continued lines joined)."""
    command, first = "", None
    for offset, line in enumerate(block):
        first = start + offset if first is None else first
        if line.rstrip().endswith("\\") and not _comment(line):
            command += line.rstrip()[:-1] + " "
            continue
        command += line
        _scan_command_tokens(found, f"{name}:{first}", _split(command), sft, full=True)
        command, first = "", None


def _scan_command_tokens(found: Found, where: str, tokens: list[str], sft: bool, full: bool) -> None:
    """One command line's tokens. ``full``: a whole command (else a fragment in prose, flags only)."""
    tools = [i for i, t in enumerate(tokens) if re.fullmatch(r"tools/\w+\.py", t)]
    if tools:
        script, rest = tokens[tools[0]], tokens[tools[0] + 1 :]
        source = (ROOT / script).read_text() if (ROOT / script).is_file() else ""
        for token in rest:
            flag = token.split("=", 1)[0]
            if re.fullmatch(rf"--{KEY}", flag):
                found.keys.append((where, tuple(flag[2:].split(".")), False, {}))
            elif flag.startswith("--") and source and f'"{flag}"' not in source:
                found.problems.append(f"{where}: {script} has no option {flag}")
        return
    module = [i for i, t in enumerate(tokens[:-1]) if t == "-m" and tokens[i + 1] == "grpo_lightning"]
    if full and not module:
        return
    rest = tokens[module[0] + 2 :] if module else tokens
    if module:
        if rest[:1] == ["sft"]:
            sft, rest = True, rest[1:]
        if not rest or rest[0] not in SUBCOMMANDS:
            found.problems.append(f"{where}: grpo_lightning needs a subcommand ({', '.join(sorted(SUBCOMMANDS))})")
            return
        rest = rest[1:]
    configs, keys, context = [], [], {}
    for i, token in enumerate(rest):
        if not token.startswith("--"):
            continue
        flag = token[2:].split("=", 1)[0].rstrip("+")
        if flag == "config" and i + 1 < len(rest):
            configs.append(rest[i + 1])
        elif re.fullmatch(KEY, flag):
            keys.append(flag)
        elif module and flag not in CLI_FLAGS:
            found.problems.append(f"{where}: grpo_lightning has no option --{flag}")
    for config in configs:
        context.update(_config_class_paths(config))
    for key in keys:
        found.keys.append((where, tuple(key.split(".")), sft, context))
    if module and full:
        found.commands.append((where, configs, keys))


@cache
def _config_class_paths(config: str) -> dict[tuple, str]:
    """The ``class_path`` at each key prefix of a config file (what its ``init_args`` keys belong to)."""
    path = ROOT / config
    if not path.is_file():
        return {}
    context: dict[tuple, str] = {}
    _walk_yaml(Found(), config, 0, yaml.compose(path.read_text()), (), False, context)
    return {tuple(s for s in prefix if not isinstance(s, int)): value for prefix, value in context.items()}


def _scan_yaml_block(found: Found, name: str, start: int, text: str, sft: bool) -> None:
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as err:
        found.problems.append(f"{name}:{start}: the YAML block does not parse ({' '.join(str(err).split())[:120]})")
        return
    if not isinstance(node, yaml.MappingNode):
        return  # a fragment (a list item of some section): nothing to anchor its keys to
    top = [key.value for key, _ in node.value]
    if not set(top) & set(SECTIONS):
        return  # a fragment below a section
    for key, _ in node.value:
        if key.value not in (*SECTIONS, *TOP_LEVEL):
            found.problems.append(f"{name}:{start + key.start_mark.line}: '{key.value}' is not a config section")
    _walk_yaml(found, name, start - 1, node, (), sft, {})


def _walk_yaml(found: Found, name: str, line0: int, node: Any, prefix: tuple, sft: bool, context: dict) -> None:
    """Every mapping key under ``node`` as a key with its full path (list items as indices); each ``class_path``
    recorded in ``context`` for the ``init_args`` beside it."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value in ("...", "…"):
                continue
            segments = (*prefix, key.value)
            if prefix:  # a block's top-level keys are checked as sections
                found.keys.append((f"{name}:{line0 + key.start_mark.line + 1}", segments, sft, context))
            if key.value == "class_path" and isinstance(value, yaml.ScalarNode):
                context[prefix] = value.value
                found.classes.append((f"{name}:{line0 + value.start_mark.line + 1}", value.value))
            _walk_yaml(found, name, line0, value, segments, sft, context)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk_yaml(found, name, line0, item, (*prefix, index), sft, context)


# ----------------------------------------------------------------------------------------------- resolving keys
@cache
def _sections(sft: bool) -> dict[str, type]:
    from lightning import Trainer

    # The modules whose classes a class_path may name without a config saying so (engines, strategies).
    import grpo_lightning.callbacks  # noqa: F401
    import grpo_lightning.engines.hf  # noqa: F401
    import grpo_lightning.engines.lean  # noqa: F401
    import grpo_lightning.integrations.environments  # noqa: F401
    import grpo_lightning.integrations.vllm.engine  # noqa: F401
    import grpo_lightning.integrations.vllm.server  # noqa: F401
    import grpo_lightning.strategies  # noqa: F401
    from grpo_lightning.integrations.sft import SFTDataModule, SFTModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.rollout.datamodule import RolloutDataModule

    if sft:
        return {"model": SFTModule, "data": SFTDataModule, "trainer": Trainer}
    return {"model": GRPOModule, "data": RolloutDataModule, "trainer": Trainer}


def import_object(path: str) -> Any:
    """The object at a dotted import path (``pkg.module.Name`` or ``pkg.module:name``); raises if none (also for a
    placeholder such as ``...``)."""
    if not re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*)?", path):
        raise ModuleNotFoundError(path)
    if ":" in path:
        module, _, name = path.partition(":")
        return getattr(importlib.import_module(module), name)
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


@cache
def _parameters(cls: type) -> dict[str, Any] | None:
    """``cls``'s settings and their type hints (None: it takes ``**kwargs``, so any name)."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    try:
        hints = typing.get_type_hints(cls.__init__ if not dataclasses.is_dataclass(cls) else cls)
    except Exception:  # a hint only importable under TYPE_CHECKING: its keys are then not checked further
        hints = {}
    return {name: hints.get(name, Any) for name in signature.parameters}


_OPEN = (dict, typing.Mapping, Any, object)
_LEAVES = (str, int, float, bool, bytes, type(None), Path)


def _classes_of(hint: Any) -> tuple[list[type], bool]:
    """The classes whose settings may follow a key of type ``hint``, and whether any nested key is allowed."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _OPEN or origin in (dict, typing.Mapping) or isinstance(hint, (str, typing.ForwardRef)):
        return [], True
    if origin is typing.Literal:
        return [], False
    if origin is not None and origin not in (type,):
        classes, anything = [], False
        for arg in args:
            inner, open_ = _classes_of(arg)
            classes += inner
            anything |= open_
        return classes, anything
    if isinstance(hint, type) and not issubclass(hint, _LEAVES) and hint.__module__ not in ("datetime", "builtins"):
        return [hint], False
    return [], False


def _subclasses(classes: Iterable[type]) -> list[type]:
    seen, todo = [], list(classes)
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo += cls.__subclasses__()
    return seen


def resolve(segments: tuple, sft: bool, context: dict) -> str | None:
    """None when the key exists, else why not (one line)."""
    dotted = ".".join(str(s) for s in segments if not isinstance(s, int))
    if dotted in PENDING_KEYS or any(dotted.startswith(p + ".") for p in PENDING_KEYS):
        return None
    if found := respell(dotted):  # a deprecated key still read (``renamed_keys``): it exists where it moved
        return resolve(tuple(found[1].split(".")), sft, context)
    head, rest = segments[0], segments[1:]
    sections = _sections(sft)
    if head not in sections:
        return None if head in TOP_LEVEL else f"'{head}' is not a config section"
    classes, prefix, path = [sections[head]], (head,), head
    for segment in rest:
        if isinstance(segment, int):
            prefix = (*prefix, segment)
            continue
        if segment == "class_path":
            return None  # its value is checked as a class path
        if segment == "init_args":
            named = context.get(prefix) or context.get(tuple(s for s in prefix if not isinstance(s, int)))
            if named:
                try:
                    classes = [import_object(named)]
                except (ImportError, AttributeError):
                    return None  # a placeholder (my_pkg.MyEnv); a grpo_lightning one is reported as a class path
            else:
                classes = _subclasses(classes)
            prefix, path = (*prefix, segment), f"{path}.{segment}"
            continue
        hint, known = None, False
        for cls in classes:
            parameters = _parameters(cls)
            if parameters is None:
                return None
            if segment in parameters:
                hint, known = parameters[segment], True
                break
        if not known:
            names = sorted({c.__name__ for c in classes})
            names = "/".join(names[:3]) + ("/..." if len(names) > 3 else "") if names else "a plain value"
            return f"unknown key {path}.{segment} ({path} is {names}: no setting '{segment}')"
        classes, anything = _classes_of(hint)
        if anything:
            return None
        prefix, path = (*prefix, segment), f"{path}.{segment}"
    return None


# --------------------------------------------------------------------------------------------- other checks
def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [e for part in match.group(1).split(",") for e in _expand_braces(path.replace(match.group(0), part, 1))]


def check_path(path: str) -> str | None:
    for each in _expand_braces(path):
        if not (list(ROOT.glob(each)) if "*" in each else (ROOT / each).exists()):
            return f"no such path {each}"
    return None


def check_class(path: str) -> str | None:
    top = re.split(r"[.:]", path)[0]
    if not top.isidentifier() or importlib.util.find_spec(top) is None:
        return None  # a placeholder package (my_pkg): not ours to import
    try:
        import_object(path)
    except (ImportError, AttributeError) as err:
        return f"{path} does not import ({type(err).__name__}: {err})"
    return None


def check_param(class_path: str, name: str) -> str | None:
    try:
        parameters = _parameters(import_object(class_path))
    except (ImportError, AttributeError):
        return None  # reported as a class path
    if parameters is not None and name not in parameters:
        return f"{class_path} has no parameter '{name}'"
    return None


def heading_text(heading: str) -> str:
    """A heading's text as rendered: inline code, emphasis and link markup dropped, an attr_list ``{...}`` too."""
    text = re.sub(r"\s*\{[^{}]*\}\s*$", "", heading.strip())
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    parts = re.split(r"`([^`]*)`", text)  # odd parts: code spans, kept as they are
    outside = [re.sub(r"(?<!\w)[*_]{1,2}|[*_]{1,2}(?!\w)", "", part) for part in parts[::2]]
    parts[::2] = outside
    return "".join(parts).strip()


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens (a repeat gets ``-1``)."""
    return re.sub(r"[^\w\- ]", "", heading_text(heading).lower()).replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """mkdocs' anchor of a heading (Python-Markdown ``toc``'s default slugify): accents and every non-ASCII
    character dropped (``π_old`` is ``_old``), punctuation dropped, runs of spaces and hyphens one hyphen."""
    text = unicodedata.normalize("NFKD", heading_text(heading)).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors_of(text: str, github: bool = False) -> set[str]:
    """The anchors of a markdown document's headings (``#`` lines in code blocks are none), as GitHub makes them
    (the README) or as mkdocs does (a docs page: a repeated heading gets ``_1``, ``_2``; ``{#id}`` sets one)."""
    found: list[str] = []
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    for heading in re.findall(r"^#+\s+(.*?)\s*#*\s*$", text, re.M):
        explicit = re.search(r"\{[^{}]*#([\w-]+)[^{}]*\}\s*$", heading)
        base = explicit.group(1) if explicit else (github_slug if github else mkdocs_slug)(heading)
        anchor, n = base, 0
        while anchor in found:
            n += 1
            anchor = f"{base}-{n}" if github else f"{base}_{n}"
        found.append(anchor)
    return set(found)


def check_link(document: str, target: str, own_anchors: set[str]) -> str | None:
    """A relative link's file and anchor exist; from a docs page, the file is a page or file of the site."""
    if re.match(r"[a-z]+:", target):
        return None  # https:, mailto:
    file, _, anchor = target.partition("#")
    if not file:
        return None if anchor in own_anchors else f"link to a missing anchor {target}"
    if file.startswith("/"):
        return f"absolute link {target}: link relative to the page"
    resolved = ((ROOT / document).parent / file).resolve()
    if not resolved.exists():
        return f"link to a missing file {target}"
    site = document.startswith("docs/")
    if site and not resolved.is_relative_to(ROOT / "docs"):
        return f"link out of docs/ to {target}: not a page of the site; name the file as code (`{file.lstrip('./')}`)"
    if anchor and resolved.suffix == ".md" and anchor not in page_anchors(resolved, github=not site):
        return f"link to a missing anchor {target}"
    return None


def page_anchors(page: Path, github: bool) -> set[str]:
    """A page's anchors; the settings page's are those of the page the build writes (a key's ``<a id>``)."""
    if page == ROOT / SETTINGS_PAGE:
        return set(re.findall(r'<a id="([^"]+)"', _settings_reference()))
    return anchors_of(page.read_text(), github=github)


@cache
def _settings_reference() -> str:
    return load_tool("settings_reference").reference()


@cache
def _header_overrides() -> dict[str, set[str]]:
    """For each config: the override keys that every command in any config's header composing it passes."""
    commands: dict[str, list[set[str]]] = {}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        for line in path.read_text().splitlines():
            if re.match(r"#\s+python -m grpo_lightning", line):
                tokens = _split(line.lstrip("# "))
                keys = {t[2:] for t in tokens if re.fullmatch(rf"--{KEY}", t)}
                for i, token in enumerate(tokens[:-1]):
                    if token == "--config":
                        commands.setdefault(tokens[i + 1], []).append(keys)
    return {config: set.intersection(*sets) for config, sets in commands.items()}


def problems(found: Found) -> list[str]:
    """Every problem in what ``scan`` found, as ``file:line: what``."""
    out, reported = list(found.problems), set()
    for where, segments, sft, context in found.keys:
        if (why := resolve(segments, sft, context)) is not None:
            # The keys below an unknown one in the same YAML block or command (same context) are not reported again.
            unknown = why.split(" (")[0].removeprefix("unknown key ")
            below = ".".join(str(s) for s in segments if not isinstance(s, int)) != unknown
            if not (below and (where.split(":")[0], id(context), unknown) in reported):
                out.append(f"{where}: {why}")
            reported.add((where.split(":")[0], id(context), unknown))
    checks: list[tuple[str, Callable[[], str | None]]] = [
        *((w, lambda p=p: check_path(p)) for w, p in found.paths),
        *((w, lambda c=c: check_class(c)) for w, c in found.classes),
        *((w, lambda c=c, n=n: check_param(c, n)) for w, c, n in found.params),
        *((w, lambda d=d, t=t: check_link(d, t, found.anchors)) for w, d, t in found.links),
    ]
    out += [f"{where}: {why}" for where, check in checks if (why := check()) is not None]
    overrides = _header_overrides()
    for where, configs, keys in found.commands:
        for config in configs:
            missing = sorted(overrides.get(config, set()) - set(keys))
            if missing:
                out.append(
                    f"{where}: a command with {config} leaves out {', '.join('--' + k for k in missing)}"
                    " (every command in the configs' headers that composes it sets it)"
                )
    out = list(dict.fromkeys(out))  # a class path in a YAML block is seen as code and as a class_path
    return sorted(out, key=lambda line: int(re.match(r"[^:]*:(\d+)", line).group(1)))


def check_pip(name: str, text: str) -> list[str]:
    """``pip install 'grpo_lightning[x]'`` is for a published package; a checkout installs ``-e ".[x]"``, and each
    extra named must be one of pyproject.toml's."""
    # tomllib is 3.11+: the extras are the `name = [...]` lines of pyproject.toml's optional-dependencies table.
    table = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", table, re.M))
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if re.search(r"pip install\s+['\"]?grpo[_-]lightning\b", line):
            out.append(f"{name}:{number}: `pip install grpo_lightning...`: a checkout installs with pip install -e")
        for match in re.finditer(r"pip install -e\s+['\"]?\.\[([\w,-]+)\]", line):
            out += [
                f"{name}:{number}: no extra '{e}' in pyproject.toml"
                for e in match.group(1).split(",")
                if e not in extras
            ]
    return out


# -------------------------------------------------------------------------------------------------------- tests
def _read(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.mark.parametrize("name", DOCS)
def test_doc_names_only_what_exists(name):
    """Every key, path, class, flag, command and link the document names exists (file:line for each that does
    not)."""
    text = _read(name)
    found = problems(scan(name, text)) + check_pip(name, text)
    assert not found, f"{len(found)} reference(s) in {name} that do not exist:\n" + "\n".join(found)


SAMPLE = """# A made-up document

```bash
python -m grpo_lightning fit --config configs/quickstart.yaml --data.sampling.group_size 16
python -m grpo_lightning fit --config configs/quickstart.yaml --data.sampling.group_sise 16 --bogus 1
python -m grpo_lightning fit --config configs/quickstart.yaml --config configs/lora.yaml --model.objective.beta 0
python tools/bench_trl.py --settings A --no_such_flag
```

```yaml
model:
  objective:
    beta: 0.0
    betta: 0.1
data:
  engine:
    class_path: grpo_lightning.integrations.vllm.server.VLLMServerEngine
    init_args:
      base_urls: [http://127.0.0.1:8000]
      base_url: http://127.0.0.1:8000
trainer:
  callbacks:
    - class_path: grpo_lightning.callbacks.NoSuchCallback
```

| key | meaning |
|---|---|
| `data.advantage.scale` / `std` / `stdd` | ... |
| `grpo_lightning.callbacks.KLController` (`target_kl`, `horizon_`) | ... |

See `configs/recipes/{grpo,dapo,nope}.yaml`, `tools/no_such_tool.py`, `rollout/round.py`, [a](#a-made-up-document),
[b](#no-such-anchor), `data.rewards: [{name: exact_answer, weigth: 1}]`, `pip install 'grpo_lightning[math]'` and
`pip install -e ".[nope]"`.

## Where π_old comes from

[c](#where-_old-comes-from), [d](#where-π_old-comes-from), [e](../configs/quickstart.yaml),
[f](losses.md#the-policy-losses), [g](losses.md#no-such-heading).
"""


def test_the_checker_finds_and_flags():
    """The extractor finds a known key on a command line and flags a fake one of every kind, at its line."""
    found = scan("docs/sample.md", SAMPLE)
    keys = {".".join(str(s) for s in segments) for _, segments, _, _ in found.keys}
    assert {"data.sampling.group_size", "data.advantage.std", "data.engine.init_args.base_urls"} <= keys
    flagged = problems(found) + check_pip("docs/sample.md", SAMPLE)
    expected = {
        "docs/sample.md:5: unknown key data.sampling.group_sise",
        "docs/sample.md:5: grpo_lightning has no option --bogus",
        "docs/sample.md:6: a command with configs/lora.yaml leaves out --model.lr",
        "docs/sample.md:7: tools/bench_trl.py has no option --no_such_flag",
        "docs/sample.md:14: unknown key model.objective.betta",
        "docs/sample.md:20: unknown key data.engine.init_args.base_url",
        "docs/sample.md:23: grpo_lightning.callbacks.NoSuchCallback does not import",
        "docs/sample.md:28: unknown key data.advantage.stdd",
        "docs/sample.md:29: grpo_lightning.callbacks.KLController has no parameter 'horizon_'",
        "docs/sample.md:31: no such path configs/recipes/nope.yaml",
        "docs/sample.md:31: no such path tools/no_such_tool.py",
        "docs/sample.md:32: link to a missing anchor #no-such-anchor",
        "docs/sample.md:32: unknown key data.rewards.weigth",
        "docs/sample.md:32: `pip install grpo_lightning...`",
        "docs/sample.md:33: no extra 'nope'",
        "docs/sample.md:37: link to a missing anchor #where-π_old-comes-from",  # GitHub's anchor, not mkdocs'
        "docs/sample.md:37: link out of docs/ to ../configs/quickstart.yaml",
        "docs/sample.md:38: link to a missing anchor losses.md#no-such-heading",
    }
    missing = {e for e in expected if not any(f.startswith(e) for f in flagged)}
    extra = [f for f in flagged if not any(f.startswith(e) for e in expected)]
    assert not missing and not extra, f"missing: {sorted(missing)}\nextra: {extra}"


def _trl_rows() -> list[tuple[int, str, str]]:
    """The TRL table of docs/coming_from_trl.md: (line, TRL field, our side) for each row."""
    rows = []
    for number, line in enumerate(_read(TRL_DOC).splitlines(), start=1):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) >= 2 and (name := re.fullmatch(r"`(\w+)`", cells[0])):
            rows.append((number, name.group(1), cells[1]))
    return rows


def test_coming_from_trl_maps_every_grpo_config_field():
    """A row for each field of TRL's GRPOConfig (TrainingArguments' included), each with our key or a reason it
    does not apply, and no row for a field TRL does not have. The keys in it are checked by the test above."""
    trl = pytest.importorskip("trl")
    fields = [f.name for f in dataclasses.fields(trl.GRPOConfig)]
    rows = _trl_rows()
    named = [name for _, name, _ in rows]
    missing = [f for f in fields if f not in named]
    unknown = [f"{TRL_DOC}:{n}: {name}" for n, name, _ in rows if name not in fields]
    # Our side: a key (some inline code), or "not applicable: " and the reason.
    unmapped = [
        f"{TRL_DOC}:{n}: {name}"
        for n, name, ours in rows
        if not (re.match(r"not applicable: \S", ours) or (not ours.startswith("not applicable") and "`" in ours))
    ]
    repeated = sorted({name for name in named if named.count(name) > 1})
    assert not missing, f"GRPOConfig fields of trl {trl.__version__} missing from {TRL_DOC}: {missing}"
    assert not unknown, f"rows for fields GRPOConfig (trl {trl.__version__}) does not have: {unknown}"
    assert not unmapped, f"rows with neither a key of ours nor 'not applicable: <reason>': {unmapped}"
    assert not repeated, f"rows repeated: {repeated}"


# ------------------------------------------------------------------------------------------------------ the site
def _nav_pages(node: Any) -> Iterator[str]:
    """The page paths of an mkdocs ``nav`` (nested lists of ``{title: page or section}``)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_pages(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_pages(value)


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml's YAML: its ``!!python/name:`` tags (the mermaid fence's formatter) read as their names."""


_MkdocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    """mkdocs strict fails on both too; this says so in the suite, without running mkdocs."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkdocsLoader)
    nav = [page for page in _nav_pages(config["nav"]) if not re.match(r"[a-z]+:", page)]
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert config["docs_dir"] == "docs" and config["strict"] is True
    assert not sorted(set(pages) - set(nav)), f"pages left out of mkdocs.yml's nav: {sorted(set(pages) - set(nav))}"
    assert not sorted(set(nav) - set(pages)), f"nav entries with no page: {sorted(set(nav) - set(pages))}"
    assert len(nav) == len(set(nav)), "a page listed twice in the nav"


def test_the_readme_is_a_first_read():
    """The README stays a five-minute read: the manual is the site."""
    lines = len(_read("README.md").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}: move the rest to docs/)"
    )


def test_anchors_are_the_ones_mkdocs_makes():
    """Every heading anchor the link check expects on a docs page is an id Python-Markdown's ``toc`` (mkdocs') gives
    it, and none is missing: rendered with the extensions of mkdocs.yml that change headings."""
    markdown = pytest.importorskip("markdown")
    pytest.importorskip("pymdownx.superfences")
    for name in [n for n in DOCS if n.startswith("docs/")]:
        text = _read(name)
        html = markdown.markdown(text, extensions=["toc", "attr_list", "tables", "pymdownx.superfences"])
        rendered = set(re.findall(r'<h[1-6][^>]* id="([^"]+)"', html))
        ours = anchors_of(text)
        assert ours == rendered, f"{name}: ours only {sorted(ours - rendered)}, mkdocs' only {sorted(rendered - ours)}"
