"""What the README and the pages under ``docs/`` say that a program can check, read the
way a reader reads them: the inline code spans with the paragraph around each, the
commands of the console blocks, the command synopses; and what the code says, to hold
them to: the parsers of every command, benchmark and example script, the environment
variables the package reads, the metrics ``/metrics`` exposes and the texts the package
can print. ``tests/test_docs_prose.py`` compares the two."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .docblocks import blocks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ["protocol", "coordinator", "worker", "torch_bridge", "ray_bridge"]
EXAMPLES = ROOT / "examples"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
_GENERATED = re.compile(r"<!-- generated: [\w-]+ -->\n.*?<!-- end generated -->", re.S)
_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
_SEPARATORS = {"|", "||", "&&", ";", "&"}


def pages(*, references: bool = True) -> list[Path]:
    """The README and every page of the site (the generated references too, unless not)."""
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", *(p for p in docs if references or "reference" not in p.parts)]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blank(match: re.Match[str]) -> str:
    """A matched region with its text gone and its lines kept (lines still count)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(page: Path, *, generated: bool = True) -> str:
    """The page without its fenced blocks (nor its generated figures, unless asked)."""
    text = _FENCE.sub(_blank, page.read_text())
    return text if generated else _GENERATED.sub(_blank, text)


@dataclass(frozen=True)
class Span:
    """An inline code span: its text (a span broken over lines is joined with a space),
    where it is, and the paragraph it sits in."""

    page: Path
    line: int
    text: str
    paragraph: str

    def __str__(self) -> str:
        return f"{name(self.page)}:{self.line}: `{self.text}`"


def _paragraphs(text: str) -> Iterator[tuple[int, str]]:
    """(offset, text) of every paragraph: text between blank lines."""
    for found in re.finditer(r"(?:^[^\n]*\S[^\n]*(?:\n|$))+", text, re.M):
        yield found.start(), found.group(0)


def spans(page: Path, *, generated: bool = True) -> list[Span]:
    text = prose(page, generated=generated)
    found = []
    for start, paragraph in _paragraphs(text):
        for match in _SPAN.finditer(paragraph):
            line = text.count("\n", 0, start + match.start()) + 1
            joined = " ".join(match.group(1).split())
            found.append(Span(page, line, joined, " ".join(paragraph.split())))
    return found


def fenced(page: Path) -> list[tuple[str, int, str]]:
    """(language, line, text) of every fenced block of a page."""
    text = page.read_text()
    return [
        (m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2)) for m in _FENCE.finditer(text)
    ]


# --- the parsers ---------------------------------------------------------------------


@cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by the words that name it (``shardwire bench fsdp``), the
    walk of ``tests/test_cli_help.py``: the launcher's, each tool's, each benchmark's,
    and their subcommands."""
    from .test_cli_help import _parsers

    return _parsers()


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}  # noqa: SLF001


@cache
def example_options() -> dict[str, set[str]]:
    """The options of each example script (``examples/NAME.py``), read from its source and
    from the sibling modules it imports from (``outer.py``, ``recovery.py``): reading them
    does not import torch, which ``torch_charlm.py`` needs."""
    found = {}
    for script in sorted(EXAMPLES.glob("*.py")):
        tree = ast.parse(script.read_text())
        sources = [tree]
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                sibling = EXAMPLES / f"{node.module}.py"
                if sibling.is_file():
                    sources.append(ast.parse(sibling.read_text()))
        flags = set()
        for source in sources:
            for node in ast.walk(source):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                    flags |= {
                        a.value
                        for a in node.args
                        if isinstance(a, ast.Constant) and str(a.value).startswith("-")
                    }
        found[script.name] = flags
    return found


def words(text: str) -> list[str]:
    """A command as the shell splits it (quoted words whole; an unbalanced quote: by
    spaces)."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split()


def calls(argv: list[str]) -> Iterator[list[str]]:
    """Every ``shardwire`` invocation in a command line: the words after the program,
    up to a shell separator or to the ``--`` after which ``shardwire chaos`` runs another
    command (itself searched too), and inside a quoted ``sh -c '...'``."""
    segment: list[str] = []
    for word in [*argv, ";"]:
        if word in _SEPARATORS or word == "--" or word.endswith(";"):
            if word.endswith(";") and word != ";":
                segment.append(word[:-1])
            at = next((i for i, w in enumerate(segment) if Path(w).name == "shardwire"), None)
            if at is not None:
                yield segment[at + 1 :]
            segment = []
        elif " " in word and "shardwire" in word:
            yield from calls(words(word))
        else:
            segment.append(word)


def command_of(call: list[str]) -> tuple[str, list[str]]:
    """The command a call names (``shardwire bench collectives``) and the words after."""
    known, command, i = parsers(), "shardwire", 0
    while i < len(call) and f"{command} {call[i]}" in known:
        command, i = f"{command} {call[i]}", i + 1
    return command, call[i:]


def split_script(parser: argparse.ArgumentParser, rest: list[str]) -> tuple[list[str], list[str]]:
    """The words of a command's own options, and the script and its arguments (from the
    first positional that is not an option's value)."""
    actions = parser._option_string_actions  # noqa: SLF001
    takes = {o: a.nargs for o, a in actions.items()}
    own, i = [], 0
    while i < len(rest):
        word = rest[i]
        flag = word.split("=", 1)[0]
        if not word.startswith("-") or word == "-":
            if word.startswith(("[", "{")) or word in ("...", "…"):  # a synopsis' brackets
                own.append(word)
                i += 1
                continue
            return own, rest[i:]
        own.append(word)
        i += 1
        nargs = takes.get(flag, None)
        if "=" in word or flag not in takes or nargs == 0:
            continue
        if nargs in ("+", "*"):
            while i < len(rest) and not rest[i].startswith("-"):
                own.append(rest[i])
                i += 1
        elif i < len(rest):
            own.append(rest[i])
            i += 1
    return own, []


def flags(text_words: list[str]) -> list[str]:
    """The long options among words (``--name``, ``--name=value``, ``[--name``)."""
    found = []
    for word in text_words:
        match = re.fullmatch(r"[\[(]*(--[a-z][a-z0-9-]*)(?:=.*|[\]),.;:]*)", word)
        if match:
            found.append(match.group(1))
    return found


def parse(command: str, rest: list[str]) -> str | None:
    """Parse a call as its command would: None, or argparse's complaint."""
    known = parsers()
    if command in ("shardwire launch", "shardwire worker", "shardwire run", "shardwire"):
        from shardwire.worker.launcher.cli import parser

        p, argv = parser(), [*command.split()[1:], *rest]
    else:
        top = command.split()[:3] if command.startswith("shardwire bench ") else command.split()[:2]
        p, argv = known[" ".join(top)], [*command.split()[len(top) :], *rest]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            p.parse_args(argv)
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def console_commands() -> list[tuple[str, str]]:
    """(where, command) of every command a console block shows."""
    return [
        (f"{b.page}:{b.line}", command)
        for b in blocks()
        if b.lang == "console"
        for command in b.commands()
    ]


# --- what the code reads, exposes and prints ---------------------------------------------

_SCHEDULER = r"(?:SLURMD?|PET|OMPI|PMIX?|PMI|MV2|PALS|FLUX|LSB|PBS|COBALT)_[A-Z][A-Z0-9_]*[A-Z0-9]"
SCHEDULER = re.compile(rf"\b(?:{_SCHEDULER}|JOB_COMPLETION_INDEX)\b")
SHARDWIRE = re.compile(r"\bSHARDWIRE_[A-Z0-9_]*[A-Z0-9](?:_\*)?")


def sources() -> Iterator[Path]:
    for folder in PACKAGE:
        yield from sorted((ROOT / folder).rglob("*.py"))


@cache
def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sources()}


@cache
def _nodes() -> dict[Path, list[ast.AST]]:
    """Every node of every module, walked once."""
    return {path: list(ast.walk(tree)) for path, tree in _trees().items()}


@cache
def strings() -> list[str]:
    """Every string literal of the package (an f-string's literal parts as they stand)."""
    return [
        node.value
        for nodes in _nodes().values()
        for node in nodes
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


@cache
def _models() -> list[type]:
    """The pydantic models that read the environment: pydantic-settings models, and
    models whose fields name their variables (``validation_alias``)."""
    from pydantic import BaseModel

    for path in sources():
        text = path.read_text()
        if "BaseSettings" in text or "validation_alias" in text:
            importlib.import_module(_module(path))
    found, queue = [], list(BaseModel.__subclasses__())
    while queue:
        model = queue.pop()
        queue.extend(model.__subclasses__())
        if not model.__module__.startswith("shardwire.") or model in found:
            continue
        settings = "env_prefix" in model.model_config
        if settings or any(f.validation_alias is not None for f in model.model_fields.values()):
            found.append(model)
    return found


@cache
def variable_defaults() -> dict[str, list[object]]:
    """Every variable a model reads, with its defaults (one a model that reads it):
    ``SHARDWIRE_<FIELD>`` of a settings model, or the field's aliases."""
    found: dict[str, list[object]] = {}
    for model in _models():
        prefix = model.model_config.get("env_prefix", "")
        for field, info in model.model_fields.items():
            alias = info.validation_alias
            if alias is None and "env_prefix" not in model.model_config:
                continue
            names = (
                [f"{prefix}{field}".upper()]
                if alias is None
                else getattr(alias, "choices", [alias])
            )
            for name in names:
                found.setdefault(str(name), []).append(info.get_default(call_default_factory=True))
    return found


def _module(path: Path) -> str:
    tops = {"protocol": "protocol", "coordinator": "coordinator", "worker": "worker"}
    tops["torch_bridge"] = "torch"
    tops["ray_bridge"] = "ray"
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(["shardwire", tops[parts[0]], *parts[1:]])


@cache
def _aliases() -> set[str]:
    """The names given to pydantic's ``AliasChoices`` (the worker's torchrun variables)."""
    found = set()
    for nodes in _nodes().values():
        for node in nodes:
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "_alias",
                "AliasChoices",
            ):
                found |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return found


@cache
def variables_mentioned() -> set[str]:
    """Every ``SHARDWIRE_*`` and scheduler variable the package's texts spell, read or
    not (an error may name one), and those its models read."""
    found = set()
    for text in strings():
        if "_" in text:
            found |= {m.group(0) for m in SHARDWIRE.finditer(text) if not m.group(0).endswith("*")}
            found |= set(SCHEDULER.findall(text))
    return found | set(variable_defaults()) | _aliases()


_ENVIRON = {"environ", "env", "environment"}


def _environ(node: ast.AST) -> bool:
    """Whether a node is an environment mapping (``os.environ``, an ``environ`` or
    ``env`` argument)."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in _ENVIRON


@cache
def variables_read() -> set[str]:
    """Every environment variable the package reads: the names its code looks up in an
    environment (``environ.get(NAME)``, ``environ[NAME]``, ``NAME in environ``, a helper
    handed the environment and the name), a module's constant standing for the name
    included, and the variables its settings models read."""
    found = set()
    defined = {
        _module(path): {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets
            if isinstance(t, ast.Name) and isinstance(n.value.value, str)
        }
        for path, tree in _trees().items()
    }
    for path, tree in _trees().items():
        consts = dict(defined[_module(path)])
        for n in tree.body:  # a constant imported from the module that defines it
            if isinstance(n, ast.ImportFrom) and n.module in defined:
                consts |= {
                    a.asname or a.name: defined[n.module][a.name]
                    for a in n.names
                    if a.name in defined[n.module]
                }

        def named(node: ast.AST) -> str | None:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            return consts.get(getattr(node, "id", ""))

        for node in _nodes()[path]:
            names: list[ast.AST] = []
            if isinstance(node, ast.Call):
                func = node.func
                method = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if method in ("get", "pop", "setdefault") and _environ(
                    getattr(func, "value", func)
                ):
                    names = node.args[:1]
                elif method == "getenv" or any(_environ(a) for a in node.args):
                    names = list(node.args)
            elif isinstance(node, ast.Subscript) and _environ(node.value):
                names = [node.slice]
            elif isinstance(node, ast.Compare) and any(
                isinstance(o, ast.In | ast.NotIn) for o in node.ops
            ):
                if any(_environ(c) for c in node.comparators):
                    names = [node.left]
            found |= {n for n in map(named, names) if n and re.fullmatch(r"[A-Z][A-Z0-9_]*", n)}
    return found | set(variable_defaults()) | _aliases()


def compose_variables() -> dict[str, str]:
    """The variables ``docker-compose.yml`` interpolates, with their defaults
    (``${SHARDWIRE_WORKERS:-3}``)."""
    text = (ROOT / "docker-compose.yml").read_text()
    return dict(re.findall(r"\$\{(SHARDWIRE_[A-Z0-9_]+):-([^}]*)\}", text))


@cache
def exposed_metrics() -> set[str]:
    """The sample names ``/metrics`` exposes, as prometheus-client writes them (with the
    ``_total`` of a counter): every family the collector yields, each given a sample
    where the empty rendezvous it reads has none."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    from shardwire.coordinator import Rendezvous, RendezvousConfig
    from shardwire.coordinator.http import MetricsCollector

    families = list(
        MetricsCollector(
            Rendezvous(RendezvousConfig(run_id="r", world_size=1)), lambda: 1.0
        ).collect()
    )
    for family in families:
        if not family.samples:  # a labelled family of nothing yet: one sample of each label
            labels = getattr(family, "_labelnames", ())
            family.add_metric(["x"] * len(labels), 1.0)

    class Fixed(Collector):
        def collect(self):  # noqa: ANN202 - prometheus-client's own signature
            return iter(families)

    registry = CollectorRegistry()
    registry.register(Fixed())
    text = generate_latest(registry).decode()
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


# --- texts the package can print ---------------------------------------------------------

FIELD = "\x00"  # a formatted value inside a text


@cache
def templates() -> list[str]:
    """Every text the package spells: string literals, and f-strings, ``%`` and
    ``str.format`` templates and ``+`` concatenations with each formatted value as FIELD
    (both texts of an ``a if c else b`` of texts)."""
    found = set()
    for nodes in _nodes().values():
        for node in nodes:
            for made in _template(node) or []:
                text = re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[sdifgrx]|\{[^{}]*\}", FIELD, made)
                if text.replace(FIELD, "").strip():
                    found.add(text)
    return sorted(found)


def _template(node: ast.AST) -> list[str] | None:
    """The texts a node makes (None: it is not a text the code spells)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else FIELD for v in node.values)]
    if isinstance(node, ast.IfExp):
        body, orelse = _template(node.body), _template(node.orelse)
        return (
            None if body is None and orelse is None else [*(body or [FIELD]), *(orelse or [FIELD])]
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        if left is None and right is None:
            return None
        return [a + b for a in (left or [FIELD]) for b in (right or [FIELD])][:16]
    return None


@cache
def _letters(text: str) -> int:
    return len(_NOT_LETTERS.sub("", text))


_NOT_LETTERS = re.compile(r"[^A-Za-z]+")


@cache
def _pieces() -> list[list[str]]:
    """Every template as its literal pieces; one that sets two values side by side with
    only spaces between (``f"{a} {b}"``), which would make any words a text, is cut there
    into the templates on either side."""
    found = set()
    for template in templates():
        pieces, part = template.split(FIELD), []
        for i, piece in enumerate(pieces):
            if 0 < i < len(pieces) - 1 and not piece.strip():
                found.add((*part, ""))
                part = [""]
            else:
                part.append(piece)
        found.add(tuple(part))
    return [list(p) for p in sorted(found) if "".join(p).strip()]


@cache
def _by_ends() -> tuple[dict[str, list[list[str]]], dict[str, list[list[str]]], list[list[str]]]:
    """The pieces of every template by what a whole text of it starts with (its first
    piece), else by what it ends with (its last), and those that start and end with a
    value."""
    starts: dict[str, list[list[str]]] = {}
    ends: dict[str, list[list[str]]] = {}
    both = []
    for pieces in _pieces():
        if pieces[0]:
            starts.setdefault(pieces[0], []).append(pieces)
        elif pieces[-1]:
            ends.setdefault(pieces[-1], []).append(pieces)
        else:
            both.append(pieces)
    return starts, ends, both


def _wholes(text: str) -> Iterator[list[str]]:
    """The templates a whole ``text`` may be made by, from how it starts and ends."""
    starts, ends, both = _by_ends()
    for k in range(1, len(text) + 1):
        yield from starts.get(text[:k], ())
        yield from ends.get(text[-k:], ())
    yield from both


@cache
def _candidates(word: str) -> list[list[str]]:
    """The pieces of every template that spells ``word``."""
    return [pieces for pieces in _pieces() if any(word in p for p in pieces)]


def _formats(fragment: str) -> list[list[str]]:
    """The pieces of every template with a value in it whose literal pieces all stand in
    ``fragment`` (a format another text may fill)."""
    return [
        pieces
        for pieces in _pieces()
        if len(pieces) > 1
        and (
            all(p.strip() in fragment for p in pieces)
            or any(len(p.strip()) >= 4 and p.strip() in fragment for p in pieces)
        )
    ]


def _longest_word(text: str) -> str:
    return max(re.findall(r"[A-Za-z_]+", text) or [""], key=len)


def _wanted(text: str) -> int:
    """The letters a text must have spelled: its words but placeholders in capitals."""
    words = re.findall(r"[A-Za-z_]+", text)
    return sum(len(w) for w in words if not w.isupper() or len(w) == 1) or _letters(text)


@cache
def _pattern(pieces: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("(.*?)".join(re.escape(p) for p in pieces), re.S)


@cache
def _whole(text: str, depth: int = 3) -> int:
    """The letters of ``text`` spelled when one template makes all of it (its values, down
    ``depth`` levels, whole texts too), counted when they are three quarters of its own."""
    best = 0
    for pieces in _wholes(text):
        if not text.endswith(pieces[-1]) or not all(p in text for p in pieces):
            continue
        if len(re.findall(r"[A-Za-z]{2,}", "".join(pieces))) < 2:
            continue  # one word beside a value: too plain to say it made the text
        match = _pattern(tuple(pieces)).fullmatch(text)
        if match:
            nested = sum(_credit(v, depth - 1) for v in match.groups() if depth > 0)
            best = max(best, sum(_letters(p) for p in pieces) + nested)
    return best if best >= 0.75 * _wanted(text) else 0


@cache
def _nested(value: str, depth: int) -> int:
    """A value's letters the package spells as a whole text of words (a name shown with
    spaces for its underscores too). A single word counts for nothing: any word stands
    somewhere alone in the code."""
    value = value.strip()
    if " " not in value:
        return 0
    bare = value.strip(",;:()'\"")
    return max(_whole(v, depth) for v in {value, bare, bare.replace(" ", "_")})


@cache
def coverage(fragment: str, compose: bool = True) -> int:
    """How many letters of ``fragment`` the package's own texts spell, where ``fragment``
    is a piece of a text one template makes: its literal pieces, and (``compose``) its
    formatted values that are texts of the package themselves (a log line's format
    filled with other messages; a value the fragment starts or ends inside may be cut)."""
    best = max((_fit(fragment, p, False) for p in _candidates(_longest_word(fragment))), default=0)
    if compose and best < 0.75 * _wanted(fragment):
        best = max([best, *(_fit(fragment, p, True) for p in _formats(fragment))])
    return best


def _fit(fragment: str, pieces: list[str], compose: bool) -> int:
    best = 0
    for i, piece in enumerate(pieces):
        for k in range(len(piece)):  # the fragment starts inside piece i ...
            head = piece[k:]
            if head.startswith(fragment):
                return _letters(fragment)
            if fragment.startswith(head) and i + 1 < len(pieces):
                more = _field(fragment[len(head) :], pieces, i + 1, compose, first=False)
                if more is not None:
                    best = max(best, _letters(head) + more)
        if i > 0:  # ... or inside the value before it
            best = max(best, _field(fragment, pieces, i, compose, first=True) or 0)
    return best


def _value(text: str, compose: bool) -> int:
    return _credit(text, 3) if compose else 0


def _credit(value: str, depth: int) -> int:
    """The letters of a formatted value the page may show: those of a text of the
    package it is (a message inside a message), or all of them when it reads as a
    value from elsewhere (one word, a name or address; a text that starts with a
    capital, as the system's error texts do: ``Connection refused``)."""
    nested = _nested(value, depth)
    if nested:
        return nested
    value = value.strip(" ,;:()'\"")
    return _letters(value) if " " not in value or value[:1].isupper() else 0


def _field(fragment: str, pieces: list[str], i: int, compose: bool, *, first: bool) -> int | None:
    """Letters matched when ``fragment`` is a formatted value (the fragment's start when
    ``first``), then piece i and what follows it; or ends inside the value or inside piece
    i. None: it cannot go on."""
    piece = pieces[i]
    if not piece:
        if i + 1 < len(pieces):
            return _field(fragment, pieces, i + 1, compose, first=first)
        return _value(fragment, compose)
    best = _value(fragment, compose)  # it ends inside the value
    at = fragment.find(piece)
    while at >= 0:
        left = fragment[at + len(piece) :]
        if not left:
            more: int | None = 0
        elif i + 1 < len(pieces):
            more = _field(left, pieces, i + 1, compose, first=False)
        else:
            more = None
        if more is not None:
            value = _value(fragment[:at], compose)
            best = max(best, value + _letters(piece) + more)
        at = fragment.find(piece, at + 1)
    for cut in range(min(len(piece), len(fragment)) - 1, 0, -1):  # it ends inside piece i
        if fragment.endswith(piece[:cut]):
            value = _value(fragment[:-cut], compose)
            best = max(best, value + _letters(piece[:cut]))
            break
    return best


def produced(message: str) -> bool:
    """Whether the package can print ``message`` (the page's ``…`` or ``...`` standing
    for text left out): three quarters of the letters of each piece of it, placeholders
    in capitals (``HOST:PORT``) aside, are spelled by the package's texts."""
    message = re.sub(r"(?<= )(?:…|\.\.\.)(?= )", "N", message)  # a value left out
    for fragment in (f.strip() for f in re.split(r"…|\.\.\.", message)):
        if _letters(fragment) and coverage(fragment) < 0.75 * _wanted(fragment):
            return False
    return True


# --- names of the Python API ---------------------------------------------------------

ALIASES = {"sw": "shardwire.worker", "swt": "shardwire.torch"}  # as the pages import them


@cache
def module_names() -> dict[str, set[str]]:
    """Every module of the package (``shardwire.worker.fsdp``) with the names it defines
    or imports at its top level."""
    found: dict[str, set[str]] = {}
    for path, tree in _trees().items():
        stub = path.with_suffix(".pyi")  # a package's names imported when first read
        body = tree.body + (ast.parse(stub.read_text()).body if stub.is_file() else [])
        names = set()
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        found[_module(path)] = names
    return found


@cache
def defined_names() -> set[str]:
    """Every class, function and method name the package defines."""
    return {
        node.name
        for nodes in _nodes().values()
        for node in nodes
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    }


def resolves(dotted: str) -> bool:
    """Whether a dotted name a page gives (``shardwire.torch.PeerStorage``, ``sw.span``)
    is a module of the package, or a name one defines at its top level."""
    head, _, rest = dotted.partition(".")
    dotted = f"{ALIASES[head]}.{rest}" if head in ALIASES else dotted
    modules = module_names()
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            return cut == len(parts) or parts[cut] in modules[module]
    return False
