"""The pages' prose says what the code does: what a reader would copy or look for, read
from the README and every page under ``docs/`` (``tests/prose.py``) and held to the
code. Every option a page gives belongs to the command it is given to, and every
default it quotes is that command's; every command a console block shows parses; every
environment variable a page names is one something reads, and every one the package
reads is on the environment page; every metric named is one ``/metrics`` exposes; every
message quoted is one the package can print; every class or module named exists; every
figure quoted from a kept benchmark run names its file and is that file's, and a table
of figures is one generated from a kept run; the lists the pages keep (dtypes, fault
kinds, packages in their layers, commands, pages) are the code's. Nothing here starts
a process: the parsers, the settings models and the metrics collector are imported."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from . import prose
from .docblocks import block

ROOT = prose.ROOT
DOCS = ROOT / "docs"
KEPT = DOCS / "data" / "bench"
ENVIRONMENT = DOCS / "reference" / "environment.md"

# Options of other programs a page mentions in passing: the program the paragraph names.
FOREIGN = {
    "--abort-on-container-failure": "docker",
    "--build": "docker",
    "--build-arg": "docker",
    "--volumes": "docker",
    "--ulimit": "Docker",
    "--mca": "mpirun",
    "--oversubscribe": "mpirun",
    "--ntasks-per-node": "srun",
    "--distribution": "srun",
    "--from-literal": "kubectl",
}
_PROGRAMS = (
    r"(?:sudo |\S*/)?"
    r"(?:srun|sbatch|docker|kubectl|torchrun|mpirun|python3?|pip|make|scp|chmod|ulimit)\b"
)


# --- options -----------------------------------------------------------------------


def _script_options(script: str) -> set[str] | None:
    """The options of an example script a command runs (None: the user's own script)."""
    return prose.example_options().get(Path(script).name) if "train" not in script else None


def _page_sample_options(page: Path) -> set[str]:
    """Options a page's own Python sample reads from ``sys.argv`` (``"--fsdp" in sys.argv``)."""
    found = set()
    for lang, _line, text in prose.fenced(page):
        if lang == "python":
            found |= set(re.findall(r'"(--[a-z][a-z0-9-]*)"', text))
    return found


def _command_words(text: str) -> list[str]:
    """A span or synopsis as words, a subcommand written alone (``worker --chaos PLAN``,
    ``bench collectives --hosts``) read as the ``shardwire`` command it is."""
    words = prose.words(text.replace("[", " [").replace("]", "] "))
    words = [w for w in (w.strip() for w in words) if w]
    if words and f"shardwire {words[0]}" in prose.parsers():
        return ["shardwire", *words]
    return words


def _misplaced(where: str, text: str, paragraph: str, page: Path) -> list[str]:
    """The options in ``text`` that the command they are given to does not take."""
    words = _command_words(text)
    found = []
    calls = list(prose.calls(words))
    for call in calls:
        command, rest = prose.command_of(call)
        parser = prose.parsers()[command]
        own, script = prose.split_script(parser, rest)
        known = prose.options(parser)
        found += [f"{where}: {command} has no {f}" for f in prose.flags(own) if f not in known]
        if script:
            taken = _script_options(script[0])
            if taken is not None:
                wrong = [f for f in prose.flags(script[1:]) if f not in taken]
                found += [f"{where}: {script[0]} has no {f}" for f in wrong]
    if calls or re.match(_PROGRAMS, text):
        return found
    # an example script run by name: `digits.py --aggregator allreduce|ps`
    if words and words[0].endswith(".py"):
        taken = _script_options(words[0]) or set()
        return [f"{where}: {words[0]} has no {f}" for f in prose.flags(words[1:]) if f not in taken]
    return found + [
        f"{where}: {f}" for f in prose.flags(words) if not _bare_known(f, paragraph, page)
    ]


def _bare_known(flag: str, paragraph: str, page: Path) -> bool:
    """An option given alone: one of a command or example script the paragraph names,
    else one of those the page names or runs (or of its own sample); an option of
    another program where the paragraph names that program."""
    if flag in FOREIGN:
        return FOREIGN[flag] in paragraph
    for context in (paragraph, _page_context(page)):
        if flag in _options_of(context):
            return True
    return flag in _page_sample_options(page)


@cache
def _page_context(page: Path) -> str:
    """What a page names: its prose and the commands of its console blocks."""
    commands = [text for lang, _line, text in prose.fenced(page) if lang == "console"]
    return "\n".join([prose.prose(page), *commands])


@cache
def _options_of(text: str) -> set[str]:
    """The options of the commands a text names (``shardwire bench goodput``, `launch`,
    a coordinator) and of the example scripts it names (``examples/charlm.py``, charlm,
    "the examples": every one)."""
    found: set[str] = set()
    for command in _commands_named(text):
        found |= prose.options(prose.parsers()[command])
    for script, taken in prose.example_options().items():
        stem = script.removesuffix(".py")
        if re.search(rf"\b{stem}\b|\bexamples\b", text.replace("torch_charlm", "torch charlm")):
            if stem != "torch_charlm" or re.search(r"torch[ _]charlm", text):
                found |= taken
    return found


@cache
def _commands_named(text: str) -> set[str]:
    """The commands a text names: ``shardwire X Y``, `X` alone for a command X, and the
    coordinator and node agents by name."""
    found = set()
    for match in re.finditer(r"shardwire((?: [a-z][a-z-]*)+)", text):
        command, _rest = prose.command_of(match.group(1).split())
        if command != "shardwire":
            found.add(command)
    for word in re.findall(r"`([a-z]+)`", text):
        if f"shardwire {word}" in prose.parsers():
            found.add(f"shardwire {word}")
    if re.search(r"\bcoordinator\b", text):
        found.add("shardwire coordinator")
    return found


def test_every_option_a_page_gives_is_one_its_command_takes() -> None:
    """`shardwire launch --foo` needs launch to take --foo; an option alone needs a
    command the paragraph (or the page) names to take it; an example script's options
    are its parser's; a console block's commands and a synopsis are read alike."""
    wrong: list[str] = []
    for page in prose.pages(references=False):
        for span in prose.spans(page):
            wrong += _misplaced(str(span), span.text, span.paragraph, page)
        for lang, line, text in prose.fenced(page):
            if lang in ("", "console"):
                joined = text.replace("\\\n", " ")
                for i, shown in enumerate(joined.splitlines()):
                    command = shown.removeprefix("$ ")
                    if (
                        command.startswith(("shardwire ", "sudo ", "srun ", "STEPS="))
                        or " shardwire " in command
                    ):
                        where = f"{prose.name(page)}:{line + i}"
                        wrong += _misplaced(where, command, "", page)
    assert wrong == []


def test_every_command_a_console_block_shows_parses() -> None:
    """Each ``shardwire`` command of a console block, run through its own parser: an
    unknown option, a missing value, a choice that is not one or a missing required
    option fails here as it would for the reader."""
    wrong = []
    for where, command in prose.console_commands():
        for call in prose.calls(prose.words(command)):
            name, rest = prose.command_of(call)
            if name == "shardwire chaos" and "--" in rest:
                rest = rest[: rest.index("--")]
            complaint = prose.parse(name, rest)
            if complaint:
                wrong.append(f"{where}: {' '.join(call)}: {complaint}")
    assert wrong == []


def _invocations(page: Path) -> list[tuple[str, list[str]]]:
    """Every ``shardwire`` call a page shows, in a span or a console block: (command,
    the words after it)."""
    texts = [s.text for s in prose.spans(page)]
    texts += [
        c
        for lang, _l, body in prose.fenced(page)
        if lang == "console"
        for c in body.replace("\\\n", " ").splitlines()
    ]
    found = []
    for text in texts:
        for call in prose.calls(_command_words(text.removeprefix("$ "))):
            found.append(prose.command_of(call))
    return found


def _given(words: list[str], flag: str) -> str | None:
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(f"{flag}="):
            return word.split("=", 1)[1]
    return None


def test_a_status_command_names_the_run_its_page_started() -> None:
    """A job a page starts with ``--run-id ID`` is seen with ``shardwire status --run-id
    ID``: the coordinator refuses a client of another run, and the default run id is
    another."""
    wrong, checked = [], 0
    for page in prose.pages(references=False):
        calls = _invocations(page)
        started = {
            run
            for command, words in calls
            if command.split()[-1] in ("launch", "worker", "run", "coordinator")
            and (run := _given(words, "--run-id"))
        }
        for command, words in calls:
            if command == "shardwire status" and started and words:
                checked += 1
                run = _given(words, "--run-id") or ""
                if run not in started and not run.isupper():  # ID: any run
                    wrong.append(f"{prose.name(page)}: shardwire status {' '.join(words)}")
    assert checked >= 2
    assert wrong == []


def test_the_option_checks_catch_a_renamed_option() -> None:
    """The checks above fail on what a rename would leave behind."""
    page = DOCS / "guide" / "running.md"
    assert _misplaced("x", "shardwire launch --standalone --nprocs-per-node 4", "", page)
    assert _misplaced("x", "shardwire status --nnodes 2", "", page)
    assert _misplaced("x", "examples/charlm.py --tensor-parallel 2", "", page)
    assert _misplaced("x", "shardwire launch --standalone examples/digits.py --dp 2", "", page)
    assert not _misplaced("x", "shardwire launch --standalone examples/charlm.py --dp 2", "", page)
    assert _misplaced("x", "--no-such-option", "`shardwire bench goodput` runs it", page)
    assert prose.parse("shardwire launch", ["--recovery", "sometimes", "x.py"])
    assert prose.parse("shardwire kubernetes", ["x.py"])  # --name is required


# --- environment variables -----------------------------------------------------------


def _variables_named(text: str) -> set[str]:
    return {m.group(0) for m in prose.SHARDWIRE.finditer(text)} | set(prose.SCHEDULER.findall(text))


def test_every_variable_a_page_names_is_one_something_reads() -> None:
    """A ``SHARDWIRE_*`` or scheduler variable on a page is read by the package (its
    code, or a settings model), or interpolated by the Compose file a page runs; a
    ``SHARDWIRE_TLS_*`` stands for the names it starts."""
    read = prose.variables_read() | set(prose.compose_variables())
    unread = []
    for page in prose.pages():
        for name in sorted(_variables_named(page.read_text())):
            if name.endswith("_*"):
                if not any(r.startswith(name[:-1]) for r in read):
                    unread.append(f"{prose.name(page)}: {name}")
            elif name not in read:
                unread.append(f"{prose.name(page)}: {name}")
    assert unread == []


def test_every_variable_the_package_reads_is_on_the_environment_page() -> None:
    """Every ``SHARDWIRE_*`` or scheduler variable the package reads (or names), every
    one its models read (torchrun's included) and the XDG and thread variables; not the
    system's own (``HOME``) nor a baseline's (gloo's)."""
    ours = re.compile(
        rf"{prose.SHARDWIRE.pattern}|{prose.SCHEDULER.pattern}|XDG_\w+|\w+_NUM_THREADS"
    )
    read = {
        name
        for name in prose.variables_read() | prose.variables_mentioned()
        if ours.fullmatch(name) or name in prose.variable_defaults()
    }
    assert {"SHARDWIRE_NPROC_PER_NODE", "SHARDWIRE_HTTP_PORT", "SLURMD_NODENAME"} <= read
    assert {"SHARDWIRE_TLS_CERT", "RANK", "MASTER_ADDR", "PET_NODE_RANK"} <= read
    documented = ENVIRONMENT.read_text()
    missing = sorted(name for name in read if f"`{name}`" not in documented)
    assert missing == []


_UNITS = {"": 1, "s": 1, "ms": 1e-3, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_DEFAULT = re.compile(
    r"`(--[a-z][a-z0-9-]*|SHARDWIRE_[A-Z0-9_]+)(?: [A-Z:]+)?`(?: [a-z]+){0,2}(?: \(|, )"
    r"(?:default )?(\d[\d,]*(?:\.\d+)?)(?![\d.-])(?: (s|ms|bytes|KiB|MiB|GiB)\b)?"
)


def _flag_defaults(flag: str, context: str) -> set[float]:
    """The defaults of ``flag`` in every command ``context`` names that takes it: the
    parser's, the settings model's (``SHARDWIRE_<DEST>``), or the ``(N)`` its help ends
    with."""
    found: set[float] = set()
    for command in _commands_named(context):
        action = prose.parsers()[command]._option_string_actions.get(flag)  # noqa: SLF001
        if action is None:
            continue
        values = [
            action.default,
            *prose.variable_defaults().get(f"SHARDWIRE_{action.dest.upper()}", []),
        ]
        values += re.findall(r"\((\d+(?:\.\d+)?)\)", action.help or "")
        found |= {float(v) for v in values if _number(v)}
    return found


def _number(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


def test_every_default_a_page_quotes_is_the_code_s() -> None:
    """`--join-timeout` (300 s), `SHARDWIRE_SHM_SLOTS` slots (default 4): the default a
    page gives an option or a variable is the one its command or model has (a Compose
    variable's: the Compose file's)."""
    wrong, checked = [], 0
    for page in prose.pages(references=False):
        text = " ".join(prose.prose(page, generated=False).split())
        for match in _DEFAULT.finditer(text):
            name, value, unit = match.group(1), match.group(2), match.group(3) or ""
            quoted = float(value.replace(",", "")) * _UNITS[unit]
            if name.startswith("--"):
                paragraph = _paragraph_of(prose.prose(page), name) or text
                defaults = _flag_defaults(name, paragraph) or _flag_defaults(
                    name, _page_context(page)
                )
            else:
                defaults = {float(v) for v in prose.variable_defaults().get(name, []) if _number(v)}
                compose = prose.compose_variables().get(name)
                defaults |= {float(compose)} if compose is not None and _number(compose) else set()
            checked += 1
            if not any(abs(d - quoted) <= 1e-9 * max(1.0, abs(d)) for d in defaults):
                wrong.append(
                    f"{prose.name(page)}: {match.group(0)!r}: the code says {sorted(defaults)}"
                )
    assert checked >= 15
    assert wrong == []


# --- metrics ---------------------------------------------------------------------------


def test_every_metric_a_page_names_is_one_metrics_exposes() -> None:
    """Names as a scrape shows them: a counter with prometheus-client's ``_total``."""
    exposed = prose.exposed_metrics()
    assert {"shardwire_heartbeats_total", "shardwire_rank_step", "shardwire_slow_link"} <= exposed
    assert "shardwire_heartbeats" not in exposed
    wrong = []
    for page in prose.pages():
        for name in sorted(set(re.findall(r"\bshardwire_[a-z][a-z0-9_]*", prose.prose(page)))):
            if name not in exposed:
                wrong.append(f"{prose.name(page)}: {name}")
    assert wrong == []


def test_the_running_page_lists_every_metric() -> None:
    page = (DOCS / "guide" / "running.md").read_text()
    assert sorted(n for n in prose.exposed_metrics() if f"`{n}" not in page) == []


# --- messages --------------------------------------------------------------------------

_ERROR = re.compile(r"^[A-Z]\w*(?:Failed|Aborted|Error|Timeout|Job|Corrupt|Mismatch|Limit)$")


def _python(text: str) -> ast.AST | None:
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    try:
        return compile(text, "<span>", "exec", flags)
    except SyntaxError:
        return None


def _quoted(span: prose.Span) -> list[str]:
    """The messages a code span quotes: the text of an error made in it
    (``PeerFailed(rank, "connection lost …")``), or the span itself when it reads as a
    line the package prints (words, not code, not a command, not a formula)."""
    text = span.text
    tree = _python(text)
    if tree is not None:
        return [
            arg.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _ERROR.match(getattr(node.func, "id", ""))
            for arg in node.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        ]
    if re.match(r"(?:async|await|with|for|import|from|def|class)\b|[(\[{<]", text):
        return []
    if _command_words(text)[:1] == ["shardwire"] or re.match(_PROGRAMS, text):
        return []
    if re.search(r"(?<![\w-])--?[a-z]|[\w./-]+\.(?:py|md|json|toml|yaml|sh)\b", text):
        return []
    if re.search(r" [+×−=<>] | mod |<\w|\w\(", text):
        return []
    return [text] if re.search(r"\b[a-z][a-z'-]+ [a-z][a-z'-]+\b", text) else []


def _messages() -> list[tuple[str, str]]:
    """(where, message) of every message a page quotes: in code spans, in quotes after an
    error (`AuthFailed` ("the token does not match")), and the lines of text blocks."""
    found = []
    for page in prose.pages(references=False):
        for span in prose.spans(page, generated=False):
            found += [(str(span), m) for m in _quoted(span)]
        text = prose.prose(page, generated=False)
        for match in re.finditer(r"`(\w+)` \(\"([^\"]+)\"\)", text, re.S):
            if _ERROR.match(match.group(1)):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{prose.name(page)}:{line}", " ".join(match.group(2).split())))
        for lang, line, body in prose.fenced(page):
            if lang == "text":
                for i, row in enumerate(body.splitlines()):
                    if row.strip():
                        found.append((f"{prose.name(page)}:{line + i}", row.strip()))
    return found


def test_every_message_a_page_quotes_is_one_the_package_prints() -> None:
    """A quoted error, refusal or log line is spelled by the package: each piece between
    the page's ``…`` is a piece of a text it makes, its literal words in place and its
    values any value (a log line's format may be filled with other messages)."""
    quoted = _messages()
    assert len(quoted) >= 25
    assert [f"{where}: {m}" for where, m in quoted if not prose.produced(m)] == []


def test_the_message_check_tells_a_message_from_one_reworded() -> None:
    assert prose.produced("no heartbeat for 5.0 s …")
    assert prose.produced("lost the coordinator at HOST:PORT")
    assert not prose.produced("lost the coordinator in HOST:PORT")
    assert not prose.produced("no heartbeats for 5.0 s …")
    assert not prose.produced("this coordinator is not the one the job started")


# --- figures of kept runs ------------------------------------------------------------


def _kept(name: str) -> dict[str, Any]:
    return json.loads((KEPT / f"{name}.json").read_text())


def _pct(x: float) -> str:
    return f"{x:.1%}".replace("%", " %")


def _copies(k: dict[str, Any]) -> list[str]:
    r, over = k["result"], k["result"]["overhead"]
    mib = r["state_bytes_per_rank"] / 2**20
    return [
        k["benchmark"],
        f"a step of {r['step_ms']:.0f} ms with {mib:.1f} MiB of state per rank took "
        f"{_pct(over['1'])} longer with a copy every step",
        f"({_pct(over['5'])} and {_pct(over['20'])}: below the noise)",
        f"every rank rolled back in {r['restore_s']:.3f} s",
    ]


def _reform(k: dict[str, Any]) -> list[str]:
    times = sorted(r["reform_s"] for r in k["result"])
    assert all(r["workers"] == 1000 for r in k["result"])
    return [
        k["benchmark"],
        f"with 1,000 workers the next generation formed {times[0]:.2f}, {times[1]:.2f} and "
        f"{times[2]:.2f} s after the failure",
    ]


def _goodput(k: dict[str, Any]) -> list[str]:
    g = k["result"]
    r, live = g["modes"]["relaunch"], g["modes"]["live"]
    return [
        k["benchmark"],
        f"{g['steps']} steps of 4 ranks took {g['clean_s']:.0f} s without faults",
        f"{r['faults']} kills cost {r['goodput']:.2f} of the fault-free speed, "
        f"{r['lost_per_fault_s']:.2f} s per kill, {r['steps_lost']} steps computed twice and "
        f"{r['processes']} worker processes",
        f"{live['faults']} kills cost {live['goodput']:.2f}, {live['lost_per_fault_s']:.2f} s "
        f"per kill, {live['steps_lost']} steps computed twice and {live['processes']} processes",
        f"trained again {live['recovery_median_s']:.2f} s after a kill (median; "
        f"{r['recovery_median_s']:.2f} s relaunching)",
    ]


def _ray(k: dict[str, Any]) -> list[str]:
    t, g = k["result"]["throughput"], k["result"]["goodput"]
    ours = " and ".join(f"{p['tokens_per_s']['shardwire']:,}" for p in t["pairs"])
    gloo = " and ".join(f"{p['tokens_per_s']['gloo']:,}" for p in t["pairs"])
    ray, launch = g["modes"]["ray"], g["modes"]["launch"]

    def spread(m: dict[str, Any]) -> str:
        low, high = m["goodput_range"]
        return f"{m['goodput']:.2f} ({low:.2f}–{high:.2f})"

    return [
        k["benchmark"],
        f"{ours} tokens/s over shardwire against {gloo} over gloo, {t['ratio']:.2f}x "
        f"({t['ratio_range'][0]:.2f}–{t['ratio_range'][1]:.2f})",
        f"goodput {spread(ray)} on Ray against {spread(launch)} under launch, "
        f"{ray['lost_per_fault_s']:.1f} s lost per kill against {launch['lost_per_fault_s']:.1f} s",
        f"trains again {ray['recovery_median_s']:.1f} s after a kill (median) against "
        f"{launch['recovery_median_s']:.1f} s under launch",
    ]


def _torchft(k: dict[str, Any]) -> list[str]:
    modes = k["result"]["modes"]
    live, ft, tr = modes["live"], modes["torchft"], modes["torchrun"]
    pairs = k["result"]["pairs"]
    apart = sum(p["modes"]["torchft"]["replicas_agree"] is False for p in pairs)
    stopped = all(not p["modes"]["torchrun"]["finished"] for p in pairs)
    return [
        k["benchmark"],
        f"recovering live, goodput {live['goodput']:.2f} ({live['goodput_range'][0]:.2f}–"
        f"{live['goodput_range'][1]:.2f}), {live['lost_per_fault_s']:.2f} s lost per kill",
        f"torchft {ft['goodput']:.2f} ({ft['goodput_range'][0]:.2f}–{ft['goodput_range'][1]:.2f}), "
        f"{ft['lost_per_fault_s']:.2f} s per kill",
        f"torchrun below {tr['goodput_range'][1]:.2f}" + (" in every pair" if stopped else ""),
        f"torchft's replicas ended with different parameters in {apart} of {len(pairs)} runs"
        if apart
        else f"torchft's replicas ended with the same parameters in all {len(pairs)} runs",
    ]


def _etcd(k: dict[str, Any]) -> list[str]:
    small, large = sorted(k["results"], key=lambda r: r["workers"])
    return [
        k["benchmark"],
        f"forming a job of {small['workers']:,} workers took {small['etcd_writes_forming']} "
        f"etcd writes ({small['etcd_put_bytes_forming']:,} bytes), one of {large['workers']:,} "
        f"workers {large['etcd_writes_forming']} writes ({large['etcd_put_bytes_forming']:,} "
        "bytes), and while every worker heartbeat the writes were 0 per second",
    ]


def _rendezvous(reform: dict[str, Any], etcd: dict[str, Any]) -> list[str]:
    """The performance page's rendezvous figures: 1,000 workers from the re-formation
    runs (their first formation), 10,000 from the etcd run."""
    runs = reform["result"]
    large = max(etcd["results"], key=lambda r: r["workers"])

    def spread(key: str, digits: int = 2) -> str:
        low, high = min(r[key] for r in runs), max(r[key] for r in runs)
        return (
            f"{low:.{digits}f}–{high:.{digits}f}"
            if f"{low:.{digits}f}" != f"{high:.{digits}f}"
            else f"{low:.{digits}f}"
        )

    rss = max(r["coordinator_peak_rss_mib"] for r in runs)
    return [
        f"formed a job of 1,000 workers in {spread('rendezvous_s')} s (join median "
        f"{spread('join_p50_s')} s, 99th percentile {spread('join_p99_s')} s), the coordinator "
        f"using {spread('coordinator_cpu_s')} s of CPU and at most {rss:.0f} MiB",
        f"a job of {large['workers']:,} workers formed in {large['rendezvous_s']:.2f} s (join "
        f"median {large['join_p50_s']:.2f} s, 99th percentile {large['join_p99_s']:.2f} s), the "
        f"coordinator using {large['coordinator_cpu_s']:.2f} s of CPU and at most "
        f"{large['coordinator_peak_rss_mib']:.0f} MiB, and {large['heartbeat_cpu_share']:.2f} of "
        "a core while every worker heartbeat once a second",
    ]


def _hosts(k: dict[str, Any]) -> list[str]:
    """The slow-links guide's reading of the kept run, beside its table."""
    rows = k["result"]["rows"]
    big = [r for r in rows if r["bytes"] >= 16 << 20 and r["op"] != "broadcast"]
    ours = [r["link_fraction"] for r in big]
    kernel = [r["default_tcp_link_fraction"] for r in big if r["op"] != "all_reduce"]
    (cast,) = [r for r in rows if r["op"] == "broadcast" and r["n"] == 2 and r["bytes"] == 1 << 20]
    return [
        f"every all_reduce, all_gather and reduce_scatter from 16 MiB reaches "
        f"{min(ours):.2f}–{max(ours):.2f} of the link",
        f"all_gather and reduce_scatter reach {min(kernel):.2f}–{max(kernel):.2f}",
        f"with the mark it reads {cast['link_fraction']:.2f}",
    ]


def _slowlink(k: dict[str, Any]) -> list[str]:
    r = k["result"]
    loss = {(row["hosts"], row["mode"]): row["held_out_loss"] for row in r["rows"]}
    tokens = r["model"]["batch"] * r["model"]["context"]  # a step's
    curve = {(c["hosts"], c["mode"]): {t // tokens: v for t, v in c["curve"]} for c in r["curves"]}
    low = {n: min(curve[n, "dp"].items(), key=lambda p: p[1]) for n in (2, 4)}
    at = {mode: curve[4, mode][1500] for mode in ("diloco", "dp")}
    return [
        f"(charlm's default {r['loss_steps']:,} steps, H = {r['every']}",
        f"({loss[2, 'diloco']:.4f} against {loss[2, 'dp']:.4f} on 2 hosts, "
        f"{loss[4, 'diloco']:.4f} against {loss[4, 'dp']:.4f} on 4)",
        f"data parallel's held-out loss is lowest near step {low[2][0]:,} "
        f"({low[2][1]:.3f} and {low[4][1]:.3f})",
        f"at step 1,500 DiLoCo on 4 hosts was {at['diloco'] / at['dp'] - 1:.0%} behind "
        f"({at['diloco']:.3f} against {at['dp']:.3f})".replace("%", " %"),
    ]


def _collectives(k: dict[str, Any]) -> list[str]:
    cores = int(k["machine"].split()[0])
    return [f"Measured in one run on this {cores}-core machine"]


def _slowdemo() -> list[str]:
    """The why-slow run's kept trace: how many steps of each rank it holds."""
    events = json.loads((DOCS / "data" / "slowdemo-trace.json").read_text())["traceEvents"]
    calls = [e for e in events if e.get("ph") == "b" and e["name"] == "all_reduce"]
    ranks = {e["pid"] for e in calls}
    return [f"kept in `docs/data/slowdemo-trace.json`, {len(calls) // len(ranks)} steps)"]


def _digits(summary: dict[str, Any]) -> list[str]:
    return [f"held-out accuracy {summary['held_out_accuracy']} with the default seed"]


# (page, kept file, the sentences the page holds, made from the file)
FIGURES: list[tuple[str, str, Callable[[], list[str]]]] = [
    ("guide/elastic.md", "bench/copies.json", lambda: _copies(_kept("copies"))),
    ("guide/elastic.md", "bench/reform.json", lambda: _reform(_kept("reform"))),
    ("guide/chaos.md", "bench/goodput.json", lambda: _goodput(_kept("goodput"))),
    ("guide/chaos.md", "bench/goodput-torchft.json", lambda: _torchft(_kept("goodput-torchft"))),
    ("failures.md", "bench/etcd.json", lambda: _etcd(_kept("etcd"))),
    ("clusters.md", "bench/ray.json", lambda: _ray(_kept("ray"))),
    (
        "guide/performance.md",
        "bench/reform.json",
        lambda: _rendezvous(_kept("reform"), _kept("etcd"))[:1],
    ),
    (
        "guide/performance.md",
        "bench/etcd.json",
        lambda: _rendezvous(_kept("reform"), _kept("etcd"))[1:],
    ),
    ("guide/performance.md", "bench/collectives.json", lambda: _collectives(_kept("collectives"))),
    ("why-slow.md", "slowdemo-trace.json", _slowdemo),
    ("guide/slow-links.md", "bench/hosts.json", lambda: _hosts(_kept("hosts"))),
    ("guide/slow-links.md", "bench/slowlink.json", lambda: _slowlink(_kept("slowlink"))),
    (
        "../README.md",
        "digits-full_shard-seed0/summary.json",
        lambda: _digits(
            json.loads((DOCS / "data" / "digits-full_shard-seed0" / "summary.json").read_text())
        ),
    ),
]


def _paragraph_of(text: str, sentence: str) -> str:
    """The paragraph of ``text`` (spaces collapsed) that holds ``sentence``."""
    for _start, paragraph in prose._paragraphs(text):  # noqa: SLF001
        joined = " ".join(paragraph.split())
        if sentence in joined:
            return joined
    return ""


@pytest.mark.parametrize(("page", "kept", "said"), FIGURES, ids=[f"{p}:{k}" for p, k, _ in FIGURES])
def test_a_figure_quoted_from_a_kept_run_is_that_run_s(
    page: str, kept: str, said: Callable[[], list[str]]
) -> None:
    """Each sentence, made from the kept file, stands on the page as written, in a
    paragraph that names the file (``docs/data/...``); the command the run came from is
    on the page (a console block shows it)."""
    path = (DOCS / page).resolve()
    text = prose.prose(path, generated=False)
    for sentence in said():
        if sentence.startswith("shardwire bench "):
            assert sentence in " ".join(path.read_text().split()), sentence
            continue
        paragraph = _paragraph_of(text, sentence)
        assert paragraph, sentence
        assert f"docs/data/{kept}" in paragraph or f"docs/data/{Path(kept).parent}/" in paragraph, (
            f"the paragraph quoting {sentence!r} does not name docs/data/{kept}"
        )


def test_every_paragraph_naming_a_kept_run_has_its_figures_held() -> None:
    """A paragraph that names a kept run quotes it: its figures are held above."""
    held = {(p, k) for p, k, _ in FIGURES}
    named = set()
    for page in prose.pages(references=False):
        rel = str(page.relative_to(DOCS)) if page.is_relative_to(DOCS) else "../README.md"
        for kept in re.findall(
            r"docs/data/((?:bench/)?[\w-]+\.json)", prose.prose(page, generated=False)
        ):
            named.add((rel, kept))
    assert sorted(named - held) == []


def test_the_getting_started_run_is_the_kept_run() -> None:
    """The digits run the getting-started page shows is the one kept in
    ``docs/data/digits-full_shard-seed0``: its summary lines are the kept summary's and
    its step lines the kept metrics' (times and rates aside)."""
    folder = DOCS / "data" / "digits-full_shard-seed0"
    summary = json.loads((folder / "summary.json").read_text())
    records = {
        r["step"]: r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    }
    lines = [line.removeprefix("[rank0]: ") for line in block("main-job-output").output()]
    shown = dict(line.split(None, 1) for line in lines if line and line.split()[0] in summary)
    assert set(shown) == set(summary)
    for key, value in summary.items():
        text = shown[key].strip()
        if key == "samples_per_s":
            assert text == f"{value:.0f}"
        else:
            assert (
                json.loads(text.replace("'", '"')) == value
                if text[0] in "[0123456789"
                else text == value
            ), key
    steps = [re.match(r"step (\d+)/\d+ loss (\S+) lr (\S+) accuracy (\S+)", line) for line in lines]
    steps = [m for m in steps if m]
    assert len(steps) >= 3
    for m in steps:
        r = records[int(m.group(1))]
        assert (m.group(2), m.group(3), m.group(4)) == (
            f"{r['loss']:.4g}",
            f"{r['lr']:.4g}",
            f"{r['accuracy']:.4g}",
        )
    assert "docs/data/digits-full_shard-seed0" in " ".join(
        (DOCS / "getting-started.md").read_text().split()
    )


def _tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of a text, as rows of cells (the header and rule left out)."""
    found, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            found.append(rows[2:])
            rows = []
    return found


def test_measured_tables_are_generated_from_kept_runs() -> None:
    """A table of figures stands only between a page's generated marks, made from a kept
    run by ``scripts/docs_reference.py``: one typed in by hand has no run behind it."""
    one = r"[-+~≈]?\d[\d,.]*(?:[–-]\d[\d,.]*)?\s*(?:%|×|x|µs|ms|s|MiB|GiB|GB/s|MB/s)?"
    figure = re.compile(rf"^{one}(?:(?:, | / ){one})*$")
    wrong = []
    for page in prose.pages(references=False):
        for rows in _tables(prose.prose(page, generated=False)):
            cells = [c for row in rows for c in row[1:]]
            if cells and sum(bool(figure.match(c)) for c in cells) > len(cells) / 2:
                wrong.append(f"{prose.name(page)}: {rows[0]}")
    assert wrong == []


# --- lists on the pages that the code defines ------------------------------------------


def test_the_collectives_page_lists_every_dtype_and_reduction() -> None:
    from shardwire.protocol.tensors import ALLOWED_DTYPES
    from shardwire.worker.kernels.reduce import ReduceOp

    text = " ".join((DOCS / "guide" / "collectives.md").read_text().split())
    listed = re.search(r"dtypes: ([^.]+)\.", text)
    assert listed
    dtypes = set()
    for item in listed.group(1).split(", "):
        head = re.match(r"([a-z]+)(\d+)((?:/\d+)*)$", item)
        if head:
            dtypes |= {
                f"{head.group(1)}{bits}" for bits in [head.group(2), *head.group(3).split("/")[1:]]
            }
        else:
            dtypes.add(item)
    assert dtypes == set(ALLOWED_DTYPES)
    reductions = re.search(r"Reductions: ([A-Z, ]+)\.", text)
    assert reductions
    assert reductions.group(1).split(", ") == [op.name for op in ReduceOp]


def test_the_architecture_page_lays_out_every_package_in_its_layer() -> None:
    """The layout lists every package of the worker, lowest first as the import rule says
    (``tests/test_layout.py``'s layers), and every top-level folder of the package."""
    from .test_layout import TOP, WORKER_LAYERS

    text = (DOCS / "architecture.md").read_text()
    layout = text.split("```", 2)[1]
    units = [u for layer in WORKER_LAYERS for u in layer if u != "__init__"]
    listed = re.findall(r"^  (\w+)(?:/|\.py)", layout, re.M)
    assert sorted(listed) == sorted(units)
    level = {u: i for i, layer in enumerate(WORKER_LAYERS) for u in layer}
    assert [level[u] for u in listed] == sorted(level[u] for u in listed), listed
    for folder in TOP:
        assert re.search(rf"^{folder}/", layout, re.M), folder
    assert "DiLoCo" in layout


def test_the_home_page_and_the_readme_lead_to_every_page() -> None:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def leaves(items: list[Any]) -> list[str]:
        found = []
        for item in items:
            for value in item.values():
                found += leaves(value) if isinstance(value, list) else [value]
        return found

    pages = [p for p in leaves(nav) if p != "index.md"]
    home = (DOCS / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert [p for p in pages if f"]({p})" not in home] == []
    assert [p for p in pages if f"](docs/{p})" not in readme] == []


def test_the_chaos_guide_s_plans_are_plans_and_its_kinds_every_kind() -> None:
    """Every fault kind is described on the guide, every ``key = value`` it shows is a
    key of a plan or a fault, every TOML plan it shows loads, and the one it shows as
    an example file's is that file's."""
    import tomllib

    from shardwire.worker.chaos.plan import KINDS, Fault, Plan

    page = DOCS / "guide" / "chaos.md"
    text = prose.prose(page)
    described = re.findall(r"^- `(\w+)`:", text, re.M)
    assert sorted(described) == sorted(KINDS)
    keys = {s.text.split(" = ")[0] for s in prose.spans(page) if re.fullmatch(r"\w+ = \S+", s.text)}
    assert len(keys) >= 5
    assert sorted(keys - set(Plan.model_fields) - set(Fault.model_fields)) == []
    plans = [(line, body) for lang, line, body in prose.fenced(page) if lang == "toml"]
    assert len(plans) >= 3
    for _line, body in plans:
        Plan.model_validate(tomllib.loads(body))
    shown = page.read_text().split("`examples/chaos/rank-dies.toml`", 1)[1]
    first = shown.split("```toml\n", 1)[1].split("```", 1)[0]
    example = (ROOT / "examples" / "chaos" / "rank-dies.toml").read_text()
    assert tomllib.loads(first) == tomllib.loads(example)


def test_the_running_page_names_every_command() -> None:
    """The synopsis and the list after it name every command ``shardwire --help`` has."""
    from shardwire.worker.launcher.cli import TOOLS

    text = " ".join(prose.prose(DOCS / "guide" / "running.md").split())
    synopsis = (DOCS / "guide" / "running.md").read_text().split("```", 2)[1]
    named = set(re.findall(r"^shardwire (\w+)", synopsis, re.M))
    listed = text.split("lists every command with its purpose (also ", 1)[1].split(")", 1)[0]
    named |= set(re.findall(r"`(\w+)`", listed))
    assert named == {"launch", "worker", "run", *TOOLS}


# Names of other libraries the pages use, and words in capitals that are not code.
OTHERS = {"CheckpointException", "DeviceMesh", "ValidationError", "Dockerfile", "VmHWM"}


def test_every_name_of_the_api_a_page_gives_is_the_package_s() -> None:
    """A class or error the prose names (`PeerCopies`, `RecoveryError`) is one the
    package defines, and a dotted name (``shardwire.torch.PeerStorage``, ``sw.span``)
    one of its modules or a name one of them defines."""
    import builtins

    wrong, checked = [], 0
    for page in prose.pages(references=False):
        for span in prose.spans(page):
            text = span.text.split("(", 1)[0]
            if re.fullmatch(r"[A-Z][a-z]\w*[a-z]\w*", text):
                checked += 1
                if text not in prose.defined_names() | OTHERS and not hasattr(builtins, text):
                    wrong.append(str(span))
            for dotted in re.findall(r"^(?:sw|swt|shardwire(?=\.))(?:\.\w+)+", text):
                checked += 1
                if not prose.resolves(dotted):
                    wrong.append(f"{span}: {dotted}")
    assert checked >= 50
    assert wrong == []
