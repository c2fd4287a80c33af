"""Train a model through a pipeline of K processes: the main job, with no download.

    gpipe train                                   # GPT 'small' on the stdlib's source, K=2
    gpipe train --size tiny --steps 40            # a few seconds
    gpipe train --model resnet                    # ResNet-style CNN (batch norm) on digits
    gpipe train --model hf-llama                  # a Hugging Face Llama, as it is (gpipe[hf])
    gpipe train --stages 3 --chunks 8 --schedule 1f1b --dtype bfloat16
    gpipe train --stages 2 --replicas 2           # 2 replicas x 2 stages = 4 processes
    gpipe train --stages 2 --replicas 2 --shard   # the same, each stage sharded over its 2
    gpipe train --resume runs/gpt-small-...       # continue from the newest checkpoint
    torchrun --nproc-per-node 2 -m gpipe train    # the same, launched by torchrun

The language model (``--model gpt``) is a byte-level GPT trained on the Python standard
library's own ``.py`` files (``gpipe.data``); ``--model resnet`` trains a small ResNet with
deferred batch norm on scikit-learn's digits (``pip install 'gpipe[digits]'``);
``--model hf-llama`` trains a random byte-level Hugging Face ``LlamaForCausalLM`` on the same
text, captured and cut between its decoder layers by ``Pipe.from_model`` (``gpipe[hf]``).

The command spawns K x R local processes (``gpipe.launch``), or, when ``RANK`` and
``WORLD_SIZE`` are set (``torchrun``), runs as one of them; the job itself is the library
``gpipe.train``. Every rank builds only its own
stage; rank 0 alone prints. The output folder receives ``metrics.jsonl`` (one record per
step), ``loss.png``, ``timeline.png``/``timeline.json`` (the measured last step),
``sample.txt`` (text the language model wrote through the pipeline), ``summary.json`` and
``checkpoints/step-NNNNNN/`` (one shard per pipeline rank, see ``gpipe.checkpoint``).
Resuming reproduces the uninterrupted run exactly (see ``gpipe.train.trainer``).
"""

from __future__ import annotations

import argparse
import os
import sys

from gpipe.allocator import POLICIES
from gpipe.checkpoint import CheckpointError
from gpipe.checkpoint_integrity import choose
from gpipe.remat import REMAT_MODES
from gpipe.schedule import SCHEDULES
from gpipe.train import TASKS, ConfigError, TrainingError, resolve, run_under_torchrun
from gpipe.train import run as run_job
from gpipe.train.config import SIZES

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    # Every option defaults to None: "not given", so that presets and, on --resume, the
    # checkpoint's configuration fill it in.
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", choices=sorted(TASKS), help="gpt (default), resnet or hf-llama")
    g.add_argument("--size", choices=SIZES, help="preset (default: small)")
    g.add_argument("--seq", type=int, help="tokens per sample, gpt only (preset: 64)")
    g = parser.add_argument_group("pipeline")
    g.add_argument("-K", "--stages", type=int, help="pipeline stages (processes; default 2)")
    g.add_argument("-M", "--chunks", type=int, help="micro-batches per mini-batch (default 4)")
    g.add_argument("--schedule", choices=list(SCHEDULES), help="default: gpipe")
    g.add_argument(
        "--virtual-stages", type=int,
        help="stages per process (interleaved-1f1b, zb-v, dualpipe-v: 2)",
    )  # fmt: skip
    g.add_argument(
        "--checkpoint",
        choices=REMAT_MODES,
        help="re-materialization mode (saving: --save-every)",
    )
    g.add_argument("--balance", help="layers per stage, e.g. 3,3 (default: even)")
    g.add_argument("-R", "--replicas", type=int, help="data-parallel replicas (default 1)")
    g.add_argument(
        "--shard", action=argparse.BooleanOptionalAction, default=None,
        help="shard each stage's parameters, gradients and optimizer state over its replicas "
        "(FSDP2): about 1/R of the memory for weights (default: off)",
    )  # fmt: skip
    g = parser.add_argument_group("optimization")
    g.add_argument("--batch", type=int, help="global mini-batch size (preset)")
    g.add_argument("--steps", type=int, help="optimizer steps in all (preset)")
    g.add_argument("--lr", type=float, help="peak learning rate (preset)")
    g.add_argument("--lr-schedule", choices=["cosine", "linear", "constant"])
    g.add_argument("--warmup", type=int, help="linear warm-up steps (preset)")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.1)")
    g.add_argument("--grad-clip", type=float, help="global gradient-norm clip, 0: off (1.0)")
    g.add_argument(
        "--skip-nonfinite", type=int, metavar="N",
        help="skip up to N steps whose loss or gradients are not finite (default 0: stop)",
    )  # fmt: skip
    g.add_argument("--seed", type=int, help="initial weights, data order, dropout (0)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    g = parser.add_argument_group("output and checkpoints")
    g.add_argument("-o", "--out", help="output folder (default: runs/MODEL-SIZE-TIME)")
    g.add_argument("--resume", metavar="DIR", help="checkpoint, or run folder to continue")
    g.add_argument(
        "--strict-resume", action="store_true",
        help="stop if the newest checkpoint is damaged (default: resume from the newest intact)",
    )  # fmt: skip
    g.add_argument("--save-every", type=int, help="checkpoint every N steps, 0: at the end")
    g.add_argument("--keep", type=int, help="checkpoints to keep, 0: all (default 3)")
    g.add_argument(
        "--no-save-on-exit", dest="save_on_exit", action="store_const", const=False,
        help="on Ctrl-C or SIGTERM stop without saving the last step",
    )  # fmt: skip
    g.add_argument("--eval-every", type=int, help="validate every N steps, 0: at the end")
    g.add_argument("--eval-batches", type=int, help="validation batches (default 8)")
    g.add_argument("--sample-tokens", type=int, help="bytes of text to generate, gpt (200)")
    g.add_argument("--prompt", help="start of the generated text (default 'def ')")
    g.add_argument("--temperature", type=float, help="sampling temperature (0.8)")
    g.add_argument("--progress", choices=["auto", "bar", "lines"], help="default: auto")
    g.add_argument("--log-every", type=int, help="steps between progress lines (10)")
    g.add_argument("--threads", type=int, help="torch threads per process (cores/processes)")
    g.add_argument(
        "--cpu-allocator", choices=POLICIES,
        help="freed CPU tensors: 'cache' keeps them for reuse (faster, notably for zero-bubble "
        "schedules), 'return' gives them back (memory-bound runs); see gpipe.cpu_allocator",
    )  # fmt: skip
    g.add_argument("--timeout", type=float, help="seconds a rank waits for another (120)")
    del add


def run(args: argparse.Namespace) -> int:
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else None
    speaks = int(os.environ.get("RANK", "0")) == 0
    options = vars(args)
    try:
        if args.resume:
            folder, notes = choose(args.resume, strict=args.strict_resume)
            options = {**options, "resume": str(folder)}
            for note in notes if speaks else []:
                print(f"gpipe train: warning: {note}", file=sys.stderr)
        config = resolve(options, world_size=world_size)
    except (ConfigError, CheckpointError) as error:
        if speaks:
            text = (
                f"--resume {args.resume}: {error}" if isinstance(error, CheckpointError) else error
            )
            print(f"gpipe train: error:\n{text}", file=sys.stderr)
        return 2
    if torchrun:
        run_under_torchrun(config)
        return 0
    try:
        run_job(config)
    except ConfigError as error:
        print(f"gpipe train: error:\n{error}", file=sys.stderr)
        return 2
    except TrainingError as error:
        if error.signal_exit is not None:
            print("gpipe train: stopped by a signal", file=sys.stderr)
            return error.signal_exit
        print(f"gpipe train: {error}", file=sys.stderr)
        if len(error.failures) > 1:
            print(f"  ({len(error.failures) - 1} other rank(s) stopped with it)", file=sys.stderr)
        if os.environ.get("GPIPE_DEBUG"):
            print(error.failures[error.rank], file=sys.stderr)
        else:
            print("  set GPIPE_DEBUG=1 for the traceback", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpipe train: interrupted", file=sys.stderr)
        return 130
    return 0
