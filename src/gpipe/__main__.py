"""The ``gpipe`` command line: ``gpipe COMMAND --help`` for each command.

    gpipe demo     # train a small GPT through a pipeline in one process: loss and throughput

Each command is a module of ``gpipe.cli`` with ``configure(parser)`` and ``run(args)``.
Bad input is one line here, for every command: what the parser refuses, and what a command
raises as a ``ValueError`` (each layer's bad-input error; ``ConfigError`` lists several
problems, one line each) or a ``CheckpointError``, as ``gpipe COMMAND: error: ...`` with exit
code 2 and no traceback (``GPIPE_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from gpipe.train.checkpoint import CheckpointError

__all__ = ["main"]

COMMANDS = {
    "demo": ("gpipe.cli.demo", "train a small GPT through a pipeline in one process"),
    "plan": ("gpipe.cli.plan", "rank K, M, schedule and re-materialization for a memory budget"),
    "train": ("gpipe.cli.train", "the main job: train through K processes, with checkpoints"),
    "export": ("gpipe.cli.export", "merge a checkpoint's shards into one plain state dict"),
    "eval": (
        "gpipe.cli.eval",
        "loss and perplexity of a run or a model folder, pipelined",
    ),
    "generate": ("gpipe.cli.generate", "continue a prompt with a run or a model folder, pipelined"),
    "checkpoints": ("gpipe.cli.checkpoints", "list a run's checkpoints and whether each is intact"),
    "check": ("gpipe.cli.check", "is a pipelined step of your model its plain step? (float64)"),
}
# What a command raises for input it cannot take (not a failure of gpipe itself).
BAD_INPUT = (ValueError, CheckpointError)


class _Parser(argparse.ArgumentParser):
    """argparse's refusals as one line (its usage block is what --help is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="gpipe", description="micro-batch pipeline parallelism")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    modules = {}
    for name, (module_name, summary) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.configure(commands.add_parser(name, help=summary, description=module.__doc__))
        modules[name] = module
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args) or 0
    except BAD_INPUT as error:
        if os.environ.get("GPIPE_DEBUG"):
            raise
        print(f"gpipe {args.command}: error:{_lines(error)}", file=sys.stderr)
        return 2


def _lines(error: Exception) -> str:
    """One line after the prefix; several problems (``ConfigError``) one line each below it."""
    problems = getattr(error, "problems", None) or [str(error)]
    if len(problems) == 1:
        return " " + " ".join(str(problems[0]).split("\n"))
    return "".join(f"\n- {p}" for p in problems)


if __name__ == "__main__":
    sys.exit(main())
