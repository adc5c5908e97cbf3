"""Write the generated reference pages of the documentation site:

- ``docs/reference/cli.md``: every command's ``--help``, from the parsers themselves;
- ``docs/reference/environment.md``: every environment variable, from the settings
  models (names, types, defaults and descriptions) and the flags' help texts;
- ``docs/reference/api.md``: every public module's ``__all__``, and every error;
- the diagrams of ``scripts/diagrams.py`` (``docs/img/``).

    python scripts/docs_reference.py [--check]

``--check`` writes nothing and exits 1 when a committed page differs from what the code
says now (``make docs`` and the tests run it so).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from shardwire.worker.bench import BENCHES

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pages  # noqa: E402
import figure_pages  # noqa: E402
import slowlink_pages  # noqa: E402
from diagrams import FIGURES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "reference"
SHARDWIRE = str(Path(sys.executable).parent / "shardwire")
COMMANDS = ["launch", "worker", "run", "coordinator", "status", "checkpoint", "bench", "plot"]
COMMANDS += ["health", "trace", "kubernetes", "chaos"]
# Read outside the settings models: named here with what they do.
OTHERS = {
    "SHARDWIRE_BENCH_DIR": "Where `shardwire bench` keeps its side environments' files.",
    "SHARDWIRE_CHAOS_LOG": "Set by `shardwire chaos`: the file where the ranks note each "
    "fault they inject and what they learned of failures (unset: the plan's path + `.log`).",
    "SHARDWIRE_CHAOS_CLEAN": "Set to `1` by `shardwire chaos` for the clean run of a plan "
    'with `compare = "clean"`: the ranks note their state, and no fault is injected.',
    "XDG_CONFIG_HOME": "Where the user's secret lies from which a Slurm job's token is "
    "derived (`$XDG_CONFIG_HOME/shardwire/secret`; unset: `~/.config/shardwire/secret`).",
    "XDG_RUNTIME_DIR": "Where `launch --standalone` leaves its job's card for `shardwire "
    "status` (`$XDG_RUNTIME_DIR/shardwire`; unset: `/tmp/shardwire-UID`).",
}
# What `worker`, `launch` and `run` read from a scheduler when the flags say nothing.
SCHEDULERS = {
    "SLURM_JOB_ID": "Slurm: with `SLURM_STEP_ID`, marks a Slurm step; names the run "
    "(`slurm-JOB.STEP`), picks the coordinator's port (20000 + job id mod 10000) and "
    "derives the job's token when none is given.",
    "SLURM_STEP_ID": "Slurm: the step, in the run id.",
    "SLURM_STEP_NODELIST": "Slurm: the step's nodes (else `SLURM_JOB_NODELIST`); the first "
    "one serves the coordinator, a node's place in the list is its node rank.",
    "SLURM_JOB_NODELIST": "Slurm: the job's nodes, where the step's are not set.",
    "SLURMD_NODENAME": "Slurm: this node's name in the node list: its place there is its "
    "node rank, and the name its node id.",
    "SLURM_STEP_TASKS_PER_NODE": "Slurm: tasks per node (else `SLURM_TASKS_PER_NODE`), for "
    "`shardwire run`'s local world size.",
    "SLURM_TASKS_PER_NODE": "Slurm: tasks per node, where the step's are not set.",
    "SLURM_PROCID": "Slurm, `shardwire run`: this task's rank.",
    "SLURM_LOCALID": "Slurm, `shardwire run`: this task's local rank.",
    "SLURM_GTIDS": "Slurm, `shardwire run`: the ranks of this node's tasks.",
    "JOB_COMPLETION_INDEX": "Kubernetes Indexed Job: the node rank.",
    "PET_NNODES": "Kubeflow Trainer: the number of nodes.",
    "PET_NPROC_PER_NODE": "Kubeflow Trainer: processes per node.",
    "PET_NODE_RANK": "Kubeflow Trainer: the node rank (node 0 serves the coordinator).",
    "PET_MASTER_ADDR": "Kubeflow Trainer: the coordinator's host.",
    "PET_MASTER_PORT": "Kubeflow Trainer: the coordinator's port (29400).",
}
# Set for every worker process unless already set (one BLAS/OpenMP thread a process).
THREADS = ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"]


def _help(*argv: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    command = [SHARDWIRE, *argv, "--help"]
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"shardwire {' '.join(argv)} --help failed: {done.stderr}")
    return done.stdout.rstrip()


def _subcommands(text: str) -> list[str]:
    usage = text.split("\n\n", 1)[0]
    # a subparser's choices, which argparse follows with "..." (an option's are not)
    found = re.search(r"\{([a-z,-]+)\} \.\.\.", usage)
    return found.group(1).split(",") if found else []


def cli_page() -> str:
    out = [
        "# Command line",
        "",
        "Every command and subcommand's `--help`, as the parsers print it.",
    ]
    queue = [[], *([c] for c in COMMANDS)]
    while queue:
        argv = queue.pop(0)
        text = _help(*argv)
        out += ["", f"## `{' '.join(['shardwire', *argv])}`", "", "```text", text]
        out += ["```"]
        if argv == ["bench"]:  # its parser names the benchmarks BENCH, not {a,b,...}
            queue[0:0] = [["bench", name] for name in BENCHES]
        elif argv and argv[0] != "bench":  # a benchmark's {a,b} are choices, not commands
            queue[0:0] = [[*argv, sub] for sub in _subcommands(text)]
    return "\n".join(out) + "\n"


def _flag_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> help, over the parser and its subparsers."""
    found: dict[str, str] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public view
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                for dest, text in _flag_help(sub).items():
                    found.setdefault(dest, text)
        elif action.help and action.help != argparse.SUPPRESS:
            found.setdefault(action.dest, " ".join(action.help.split()))
    return found


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=False)
    return "unset" if value is None else f"`{value}`"


def _type(info: FieldInfo) -> str:
    text = str(info.annotation).replace("typing.", "").replace("pydantic.types.", "")
    text = re.sub(r"<class '(\w+)'>", r"\1", text)
    return text.replace("SecretStr", "secret").replace(" | None", "")


def _table(model: type[BaseModel], helps: dict[str, str], prefix: str | None) -> list[str]:
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        if info.validation_alias is not None:
            choices = getattr(info.validation_alias, "choices", [info.validation_alias])
            var = str(choices[0])
        else:
            var = f"{prefix}{name.upper()}"
        text = info.description or helps.get(name) or ""
        if not text:
            raise RuntimeError(f"{model.__name__}.{name} has no description and no flag help")
        rows.append(f"| `{var}` | {_type(info)} | {_default(info)} | {text} |")
    return rows


def environment_page() -> str:
    from shardwire.coordinator.__main__ import parser as coordinator_parser
    from shardwire.coordinator.settings import CoordinatorSettings
    from shardwire.worker.launcher.cli import parser as launch_parser
    from shardwire.worker.launcher.options import LaunchSettings, StatusSettings
    from shardwire.worker.launcher.status import parser as status_parser
    from shardwire.worker.runtime.worker_config import WorkerEnv

    status_help = _flag_help(status_parser())
    sections = [
        (
            "Every worker process",
            "What `shardwire launch`, `worker` and `run` set for a script, and what a "
            "script started otherwise (torchrun's variables included) may set itself.",
            WorkerEnv,
            {},
        ),
        (
            "`shardwire launch`, `worker` and `run`",
            "Each flag is also `SHARDWIRE_<FLAG>`; a flag on the command line wins.",
            LaunchSettings,
            _flag_help(launch_parser()),
        ),
        (
            "`shardwire coordinator`",
            "Each flag is also `SHARDWIRE_<FLAG>`; a flag on the command line wins.",
            CoordinatorSettings,
            _flag_help(coordinator_parser()),
        ),
        ("`shardwire status`", "The same rule.", StatusSettings, status_help),
    ]
    out = [
        "# Environment variables",
        "",
        "Generated from the settings models: a variable set to a value its type refuses",
        "stops the command with the variable's name and the reason.",
    ]
    for title, intro, model, helps in sections:
        out += ["", f"## {title}", "", intro, "", *_table(model, helps, "SHARDWIRE_")]
    out += ["", "## Read from a scheduler", "", "Only where the flags and `SHARDWIRE_*`"]
    out += ["say nothing ([Clusters](../clusters.md)).", "", "| variable | what it gives |"]
    out += ["|---|---|", *(f"| `{name}` | {text} |" for name, text in SCHEDULERS.items())]
    out += ["", "## Set for every worker process", "", "Besides torchrun's variables and"]
    out += ["`SHARDWIRE_*` above, the node agent sets each of these to 1 unless it is set"]
    out += ["already (as torchrun does: N processes on N cores, one BLAS thread each):", ""]
    out += [", ".join(f"`{name}`" for name in THREADS) + "."]
    out += ["", "## Others", "", "| variable | what it does |", "|---|---|"]
    out += [f"| `{name}` | {text} |" for name, text in OTHERS.items()]
    return "\n".join(out) + "\n"


# The API page: (heading, modules) in reading order. Each module shows the names of its
# ``__all__`` (every public name it has, where it has none) but its errors, which the
# Errors section lists from every module of the package.
SECTIONS = [
    ("The worker", ["shardwire.worker"]),
    ("Collectives", ["shardwire.worker.collectives"]),
    ("Sharded training", ["shardwire.worker.fsdp"]),
    ("numpy layers", ["shardwire.worker.nn"]),
    (
        "Tensor and pipeline parallelism",
        ["shardwire.worker.nn.parallel", "shardwire.worker.nn.pipeline"],
    ),
    ("Pipeline schedules", ["shardwire.worker.nn.schedules"]),
    ("Optimizers", ["shardwire.worker.optim"]),
    (
        "Training without FSDP",
        ["shardwire.worker.training.aggregation", "shardwire.worker.training.compression"],
    ),
    (
        "Training over slow links (DiLoCo)",
        [
            "shardwire.worker.training.diloco",
            "shardwire.worker.fsdp.dilococopies",
            "shardwire.worker.training.quantize",
        ],
    ),
    ("Run directories", ["shardwire.worker.runtime.runlog"]),
    ("Transports", ["shardwire.worker.transport"]),
    ("The node arena", ["shardwire.worker.arena"]),
    ("The torch.distributed backend", ["shardwire.torch"]),
    ("Jobs on a Ray cluster", ["shardwire.ray", "shardwire.ray.train"]),
    ("The coordinator", ["shardwire.coordinator"]),
    ("The wire protocol", ["shardwire.protocol"]),
]
# package -> folder, as the wheel maps them
FOLDERS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]


def module_file(module: str) -> Path:
    """The source file of ``module``: a package's ``__init__.py``, or its ``__init__.pyi``
    where it has one (its public names, imported when first read)."""
    top = ".".join(module.split(".")[:2])
    rest = module.split(".")[2:]
    base = ROOT / FOLDERS[top] / Path(*rest) if rest else ROOT / FOLDERS[top]
    if not base.is_dir():
        return base.with_suffix(".py")
    stub = base / "__init__.pyi"
    return stub if stub.is_file() else base / "__init__.py"


def public_names(module: str) -> list[str] | None:
    """``module``'s ``__all__``, read from its source (no import: torch may be absent)."""
    tree = ast.parse(module_file(module).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(elt) for elt in node.value.elts]  # type: ignore[attr-defined]
    return None


def _module_of(path: Path) -> str:
    for top, folder in FOLDERS.items():
        if path.is_relative_to(ROOT / folder):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            return ".".join([top, *parts])
    raise ValueError(path)


def errors() -> list[tuple[str, str]]:
    """(module, class) of every class deriving from ShardwireError, in any module."""
    bases: dict[tuple[str, str], list[str]] = {}
    for folder in FOLDERS.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    names = [
                        b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                        for b in node.bases
                    ]
                    bases[(_module_of(path), node.name)] = names
    found = {"ShardwireError"}
    while True:
        more = {name for (_, name), of in bases.items() if found & set(of)} - found
        if not more:
            break
        found |= more
    return sorted(key for key in bases if key[1] in found)


def api_page() -> str:
    out = ["# Python API", "", "Generated from the docstrings and each module's `__all__`."]
    failures = errors()
    error_names = {name for _, name in failures}
    for heading, modules in SECTIONS:
        out += ["", f"## {heading}"]
        for module in modules:
            out += ["", f"::: {module}", "    options:", "      show_root_heading: false"]
            names = public_names(module)
            if names is not None:
                shown = [n for n in names if n not in error_names]
                out += ["      inherited_members: true", "      members:"]
                out += [f"        - {name}" for name in shown] if shown else ["        []"]
    out += ["", "## Errors", "", "Every error shardwire raises derives from `ShardwireError`."]
    for module, name in failures:
        out += ["", f"::: {module}.{name}", "    options:", "      show_root_heading: true"]
        out += ["      heading_level: 3"]
    return "\n".join(out) + "\n"


def chaos_page() -> str:
    """The fault plan's schema, from its models."""
    from shardwire.worker.chaos.plan import KINDS, MAX_FAULTS, Fault, Plan

    out = ["# Chaos plan", "", "Generated from `shardwire.worker.chaos.plan`; see the guide"]
    out += ["[Test your job's failures](../guide/chaos.md). A plan is a TOML file (`.toml`)"]
    out += ["or YAML (any other name); an unknown key or a bad value stops `shardwire chaos`"]
    out += ["before the job starts, naming the field.", "", "## The plan", ""]
    out += ["| key | default | meaning |", "|---|---|---|"]
    meanings = {
        "seed": 'an integer: it draws the ranks of `rank = "random"` faults (the same seed, '
        "the same ranks)",
        "faults": f"the faults (below), 1 to {MAX_FAULTS}",
        "expect": "`survive` (the job exits 0) or `fail` (it does not); checked by the verdict",
        "expect_within_s": 'seconds: with `expect = "fail"`, the job is over within this long '
        "of the first fault",
    }
    for name, field in Plan.model_fields.items():
        default = "required" if field.is_required() else f"`{field.default!r}`"
        out.append(f"| `{name}` | {default} | {meanings.get(name) or field.description} |")
    out += ["", "## A fault", "", "| key | default | meaning |", "|---|---|---|"]
    for name, field in Fault.model_fields.items():
        default = "required" if field.is_required() else f"`{field.default!r}`"
        text = field.description or "one of the kinds below"
        out.append(f"| `{name}` | {default} | {text} |")
    out += ["", "Give exactly one of `rank` and `node`, and exactly one of `step`, `after_s`,"]
    out += ["`every_s` and `collective`.", "", "## Kinds", ""]
    out += ["| kind | what happens |", "|---|---|"]
    out += [f"| `{kind}` | {what} |" for kind, what in KINDS.items()]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    args = p.parse_args()
    pages = {"cli.md": cli_page(), "environment.md": environment_page(), "api.md": api_page()}
    pages["chaos-plan.md"] = chaos_page()
    files = {PAGES / name: text for name, text in pages.items()}
    files.update({ROOT / "docs" / name: draw() for name, draw in FIGURES.items()})
    files[bench_pages.PAGE] = bench_pages.page()
    files[ROOT / "docs" / "img" / "collectives-latency.svg"] = bench_pages.plot()
    files[slowlink_pages.PAGE] = slowlink_pages.page()
    files[slowlink_pages.PLOT] = slowlink_pages.plot()
    files.update(figure_pages.pages(files))
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python scripts/docs_reference.py")
        return 1 if stale else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
