"""The ``gpipe`` command line: ``gpipe COMMAND --help`` for each command.

    gpipe demo     # train a small GPT through a pipeline in one process: loss and throughput

Each command is a module of ``gpipe.cli`` with ``configure(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

COMMANDS = {
    "demo": ("gpipe.cli.demo", "train a small GPT through a pipeline in one process"),
    "plan": ("gpipe.cli.plan", "rank K, M, schedule and re-materialization for a memory budget"),
    "train": ("gpipe.cli.train", "the main job: train through K processes, with checkpoints"),
    "export": ("gpipe.cli.export", "merge a checkpoint's shards into one plain state dict"),
    "checkpoints": ("gpipe.cli.checkpoints", "list a run's checkpoints and whether each is intact"),
    "check": ("gpipe.cli.check", "is a pipelined step of your model its plain step? (float64)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpipe", description="micro-batch pipeline parallelism")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, (module_name, summary) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.configure(commands.add_parser(name, help=summary, description=module.__doc__))
        modules[name] = module
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
