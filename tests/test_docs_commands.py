"""Every ``kv8`` command the README and docs show parses and passes the command's own checks.

Commands are taken from the shell blocks (```bash / ```sh, continuation lines joined, ``NAME="..."`` assignments
of the block substituted) and from inline code spans that start with ``kv8`` or run ``-m kv8``. Placeholders
(``MODEL``, ``FILE``, ``DIR``, ``HOST:6379``) become real values; spans with ``...`` or alternatives (``|``) are
prose, not commands. Each command is parsed by kv8's own parser, and its engine options (and a data-parallel
plan, for ``--data-parallel-backend ray``) are built as the command would build them, without starting anything.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kv8.engine.args import EngineArgs
from kv8.entrypoints.cli import build_parser

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = {"MODEL": "smollm2-135m", "FILE": "data.txt", "DIR": "out_dir", "HOST:6379": "10.0.0.1:6379",
                "N": "2", "R": "0", "HOST": "127.0.0.1"}
SUBCOMMANDS = ("generate", "info", "tune", "serve", "run", "calibrate", "eval")


def _block_commands(text: str) -> list[str]:
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines: list[str] = []
        for line in joined.splitlines():   # a quoted argument that runs over lines is one line
            if lines and lines[-1].count('"') % 2:
                lines[-1] += "\n" + line
            else:
                lines.append(line)
        joined = "\n".join(line.replace("\n", " ") for line in lines)
        variables = dict(re.findall(r'^(\w+)="([^"]*)"', joined, flags=re.M))
        for line in joined.splitlines():
            line = re.sub(r"\$(\w+)", lambda m, v=variables: v.get(m.group(1), m.group(0)), line.split(" #")[0])
            if re.search(r"(^|\s|/)kv8 (" + "|".join(SUBCOMMANDS) + r")\b", line):
                commands.append(line.strip())
    return commands


def _inline_commands(text: str) -> list[str]:
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    commands = []
    for span in (" ".join(s.split()) for s in spans):
        words = span.split()
        if "..." in span or "|" in span or not re.match(r"(kv8|.*-m kv8) (" + "|".join(SUBCOMMANDS) + r")\b", span):
            continue
        if "-m kv8" in span or (len(words) >= 3 and not words[2].startswith("-")):   # a model or a prompt: a
            commands.append(span)                                                  # command, not a name in prose
    return commands


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    start = max(i for i, w in enumerate(words) if w.endswith("kv8")) + 1
    return [PLACEHOLDERS.get(w, w) for w in words[start:] if w != "&"]


COMMANDS = sorted({(doc.name, cmd) for doc in DOCS for cmd in
                   _block_commands(doc.read_text()) + _inline_commands(doc.read_text())})


def test_the_docs_show_the_commands_this_test_checks() -> None:
    shown = {cmd for _, cmd in COMMANDS}
    for expected in ("kv8 serve MODEL --data-parallel-size 2 --data-parallel-backend ray",
                     "kv8 serve MODEL --tensor-parallel-size 2 --cpu-threads-per-rank 8",
                     "kv8 serve smollm2-135m --kv-cache-dtype fp8 --port 8000"):
        assert any(expected in cmd for cmd in shown), expected
    assert any("-m kv8 serve" in cmd for cmd in shown)   # the torchrun line


@pytest.mark.parametrize("doc,command", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_a_documented_command_parses_and_validates(doc: str, command: str) -> None:
    argv = _argv(command)
    if argv[-1] == "--help":
        return
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{doc}: `{command}` is refused by kv8's parser (exit {e.code})")
    engine_args = EngineArgs.from_cli_args(ns)
    assert engine_args.model
    if getattr(ns, "data_parallel_backend", None) == "ray":
        from kv8.entrypoints.dp.app import DataParallelPlan
        from kv8.entrypoints.openai.cli_args import ServerArgs

        plan = DataParallelPlan.from_args(ServerArgs.from_cli_args(ns), engine_args)
        assert len(plan.replicas) == ns.data_parallel_size


def test_serve_takes_the_model_positionally_or_by_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    for argv in (["serve", "m1"], ["serve", "--model-id", "m1"], ["serve", "--model", "m1"], ["serve", "-m", "m1"],
                 ["serve", "m1", "--model-id", "m1"]):
        assert EngineArgs.from_cli_args(parse(argv)).model == "m1", argv
    assert EngineArgs.from_cli_args(parse(["serve"])).model == "smollm2-135m"
    with pytest.raises(SystemExit):
        parse(["serve", "m1", "--model-id", "m2"])
    assert "two models given: 'm1' and 'm2'; give one" in capsys.readouterr().err
