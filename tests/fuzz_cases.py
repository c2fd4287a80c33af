"""Random cases against plain PyTorch: the generator behind tests/test_fuzz.py and
benchmarks/fuzz.py (issue 41, "found by a generator, not by a user").

A case is drawn from its seed (and whatever the caller pins: schedule, remat, processes,
front end, features): a small float64 model (an ``nn.Sequential`` given as a model or a
factory, or a model that is not a sequence, through ``Pipe.from_model``) with some of
:data:`FEATURES`, a loss, a layout. :func:`run_case` trains it for :data:`STEPS` steps with
SGD, pipelined (in this process, or in 2 through ``gpipe.launch``) and plain
(``reference.reference_step``: gradient accumulation over the same micro-batches, the same
dropout seeds), and compares every parameter's gradient (the loss's own included), every
buffer, the loss, the evaluation output and the final weights, relative error per tensor.
``Case.line()`` is the one-line reproduction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import fuzz_models as fm
import gpipe
from gpipe.schedule.registry import SCHEDULES
from reference import reference_step, relative_error

TOLERANCE = 1e-10
STEPS = 2
REMATS = ("always", "except_last", "never")
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v", "dualpipe-v", "zb-auto"})
FRONTENDS = ("sequential", "from_model")
FEATURES = (
    "bias",  # a tensor computed from a parameter alone, used locally and passed on
    "tied",  # a parameter used on several stages
    "loss_params",  # a loss with a parameter of its own (a temperature)
    "regularizer",  # a loss that adds a term over a model parameter (of the first stage)
    "buffers",  # buffers written in forward (a counter and running mean, batch norm)
    "hooks",  # forward, pre-forward, full backward and tensor hooks
    "modes",  # eval() then train() between steps, through the Pipe or the model
    "dropout",  # random ops drawn from the global generator
    "private_gen",  # a layer drawing from its own torch.Generator
    "uneven",  # a batch that M does not divide
    "carry",  # tuples or dicts between stages (from_model: a dict out)
)
_NOT_CAPTURED = {"private_gen"}  # not drawn for from_model: torch.export takes no Generator

# Combinations known to fail on main, each with its class in issue 41: those cases are
# expected failures until the fix lands (the lead removes entries as fixes merge).
# (feature, where) -> class; where: "split" (a split backward schedule), "from_model",
# "2 processes", "remat" (re-materialization on), "any".
KNOWN_GAPS: dict[tuple[str, str], str] = {}

# Refusals that are right (a gpipe error with the remedy): feature -> what the error says.
REFUSABLE = {
    "regularizer": "",  # any: a loss reading parameters on another rank is refused (issue 41)
    # from_model: gradient hooks see M partial gradients, refused by name at the build
    "hooks": "gpipe cannot run it as the model does",
    "tied": "which this process holds together",  # a V puts a first-last tie on one rank
}


@dataclass(frozen=True)
class Case:
    seed: int
    schedule: str
    remat: str
    processes: int
    frontend: str
    features: tuple[str, ...]
    ranks: int
    virtual: int
    chunks: int
    batch: int
    kinds: tuple  # sequential: the body's layer kinds; from_model: each block's kinds
    balance: tuple[int, ...]
    carry: str = "tensor"
    loss: str = "mse"
    hooks: tuple[str, ...] = ()
    hooks_after: bool = False
    switch: str = "pipe"
    factory: bool = False
    tie: tuple[int, int] | None = None

    def line(self) -> str:
        """The one-line reproduction."""
        return (
            f"seed={self.seed} features={'+'.join(self.features) or '-'} "
            f"schedule={self.schedule} remat={self.remat} processes={self.processes} "
            f"frontend={self.frontend} | python benchmarks/fuzz.py --seed {self.seed} "
            f"--schedule {self.schedule} --remat {self.remat} --processes {self.processes} "
            f"--frontend {self.frontend} --features {','.join(self.features) or 'none'} --cases 1"
        )


def draw_case(seed: int, *, schedule=None, remat=None, processes=None, frontend=None,
              features=None) -> Case:  # fmt: skip
    """The case of ``seed``, with what is pinned left as given."""
    r = random.Random(seed)  # every value is drawn, pinned or not: a pin changes only itself
    schedule = _pinned(schedule, r.choice(list(SCHEDULES)))
    remat = _pinned(remat, r.choice(REMATS))
    processes = _pinned(processes, r.choice((1, 1, 1, 2)))
    frontend = _pinned(frontend, r.choice(("sequential", "sequential", "from_model")))
    drawn = r.sample(FEATURES, r.randint(1, 4))
    allowed = [f for f in drawn if frontend == "sequential" or f not in _NOT_CAPTURED]
    features = set(_pinned(features, allowed))
    if frontend == "sequential" and "bias" in features:
        features.add("carry")  # the bias travels as the second value of a tuple or dict
    ranks = 2 if processes == 2 else r.choice((2, 2, 3))
    spec = SCHEDULES[schedule]
    virtual = r.choice((1, 2)) if schedule == "zb-auto" else spec.default_virtual_stages
    chunks = r.randint(2 if "uneven" in features else 1, 4)
    if schedule == "dualpipe-v":
        chunks = 2 * ranks + r.randint(0, 1)
    elif schedule == "interleaved-1f1b":
        chunks = ranks * r.randint(1, 2)
    batch = 2 * chunks + (r.randint(1, chunks - 1) if "uneven" in features else 0)
    stages = ranks * virtual
    kinds, tie = _kinds(r, frontend, features, stages)
    units = len(kinds) + 2
    cuts = sorted(r.sample(range(1, units), stages - 1))
    balance = tuple(b - a for a, b in zip([0, *cuts], [*cuts, units], strict=True))
    hooks = tuple(r.sample(("forward", "pre", "backward", "tensor"), r.randint(1, 2)))
    needs_model = features & {"hooks", "regularizer"}
    factory = frontend == "sequential" and not needs_model and r.random() < 0.5
    return Case(
        seed=seed, schedule=schedule, remat=remat, processes=processes, frontend=frontend,
        features=tuple(sorted(features)), ranks=ranks, virtual=virtual, chunks=chunks,
        batch=batch, kinds=kinds, balance=balance, tie=tie,
        carry=r.choice(("tuple", "dict")) if "carry" in features else "tensor",
        loss=r.choice(("mse", "ce")), hooks=hooks if "hooks" in features else (),
        hooks_after=r.random() < 0.5, switch="pipe" if factory else r.choice(("pipe", "model")),
        factory=factory,
    )  # fmt: skip


def _pinned(value, drawn):
    return drawn if value is None else value


def _kinds(r: random.Random, frontend: str, features: set, stages: int):
    special = []
    if "bias" in features and frontend == "sequential":
        special.append("bias")
    if "buffers" in features:
        special += r.sample(["counter", "norm"], r.randint(1, 2))
    if features & {"dropout", "modes"}:  # a mode switch shows in dropout
        special.append("drop")
    if "private_gen" in features:
        special.append("private")
    if frontend == "from_model":
        blocks = [set() for _ in range(max(stages - 2, 1) + r.randint(0, 2))]
        for kind in special:
            blocks[r.randrange(len(blocks))].add(kind)
        return tuple(frozenset(b) for b in blocks), None
    body = ["dense"] * max(stages, len(special) + 2, 2) + ["dense"] * r.randint(0, 2)
    for kind in special:  # never first or last: the tie's two dense layers sit there
        body.insert(r.randint(1, len(body) - 1), kind)
    tie = (1, len(body)) if "tied" in features else None  # positions in the whole model
    return tuple(body), tie


# -- building ---------------------------------------------------------------------------------


def factory_of(case: Case):
    if case.frontend == "sequential":
        return lambda: fm.sequential(list(case.kinds), case.carry, case.tie)
    return lambda: fm.Net(
        list(case.kinds), bias="bias" in case.features, tied="tied" in case.features,
        out="dict" if "carry" in case.features else "tensor",
    ).double()  # fmt: skip


def model_of(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    return factory_of(case)()


def _dense_for_hooks(case: Case, model: nn.Module) -> nn.Linear:
    """The linear layer the hooks go on: a dense layer past the first, or a middle block's."""
    if case.frontend == "sequential":
        index = next(i for i, k in enumerate(case.kinds, 1) if k == "dense" and i > 1)
        return model[index].lin
    return model.blocks[len(case.kinds) // 2].lin


def loss_of(case: Case, model: nn.Module) -> nn.Module:
    regularized = None
    if "regularizer" in case.features:  # the first stage's weight, read by the last stage
        name = "0.lin.weight" if case.frontend == "sequential" else "inp.weight"
        regularized = model.get_parameter(name)
    loss = fm.Loss(case.loss, temperature="loss_params" in case.features, regularized=regularized)
    return loss


def data(case: Case, step: int):
    generator = torch.Generator().manual_seed(case.seed * 1000 + step)
    x = torch.randn(case.batch, fm.IN, generator=generator, dtype=torch.float64)
    width = fm.OUT if case.frontend == "sequential" else fm.IN
    if case.loss == "mse":
        return x, torch.randn(case.batch, width, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, width, (case.batch,), generator=generator)


def build_pipe(case: Case, group=None):
    """The case's Pipe, the model object behind it (None: built from a factory), its loss."""
    options = dict(
        balance=list(case.balance), chunks=case.chunks, checkpoint=case.remat,
        schedule=case.schedule, timeout=60,
        virtual_stages=case.virtual if case.schedule in ("zb-auto", "interleaved-1f1b") else None,
    )  # fmt: skip
    if group is None:
        options["devices"] = ["cpu"] * case.ranks
    else:
        options["group"] = group
    if case.frontend == "sequential" and case.tie is not None:
        options["tied"] = [[f"{i}.lin.weight" for i in case.tie]]
    model = None if case.factory else model_of(case)
    if model is not None and "hooks" in case.features and not case.hooks_after:
        fm.add_hooks(_dense_for_hooks(case, model), list(case.hooks))
    if case.factory:
        pipe = gpipe.Pipe(factory_of(case), init_seed=case.seed, **options)
    elif case.frontend == "sequential":
        pipe = gpipe.Pipe(model, **options)
    else:
        pipe = gpipe.Pipe.from_model(model, data(case, 0)[0], split="blocks", **options)
    if model is not None and "hooks" in case.features and case.hooks_after:
        fm.add_hooks(_dense_for_hooks(case, model), list(case.hooks))
    return pipe, model, loss_of(case, model if model is not None else pipe)


# -- running ----------------------------------------------------------------------------------


def _snapshot(module: nn.Module, loss_fn: nn.Module, loss, with_loss: bool) -> dict:
    grads = {n: None if p.grad is None else p.grad.detach().clone()
             for n, p in module.named_parameters()}  # fmt: skip
    if with_loss:
        grads.update({f"loss.{n}": None if p.grad is None else p.grad.detach().clone()
                      for n, p in loss_fn.named_parameters()})  # fmt: skip
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    return {"loss": float(loss) if loss is not None else None, "grads": grads, "buffers": buffers}


def _train(case: Case, module, loss_fn, step_fn, eval_target, with_loss: bool) -> dict:
    """STEPS SGD steps of ``step_fn(x, y, seed)``; with "modes", an evaluation through
    ``eval_target`` (eval(), forward, train()) before the last step."""
    params = [*module.parameters(), *loss_fn.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    record: dict = {"steps": [], "eval": None}
    for step in range(STEPS):
        x, y = data(case, step)
        if "modes" in case.features and step == STEPS - 1:
            eval_target.eval()
            with torch.no_grad():
                out = module(x)
            record["eval"] = None if out is None else fm._output(out).detach().clone()
            eval_target.train()
        loss = step_fn(x, y, 100 + step)
        record["steps"].append(_snapshot(module, loss_fn, loss, with_loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return record


def run_pipe(case: Case, rank: int | None = None) -> dict:
    """This process's part of the pipelined run: grads, buffers, losses by name, per step."""
    torch.set_num_threads(1)
    pipe, model, loss_fn = build_pipe(case, None if rank is None else dist.group.WORLD)
    target = model if case.switch == "model" and model is not None else pipe
    last = pipe._holds(pipe.num_stages - 1)

    def step(x, y, seed):
        return pipe.step(x, y, loss_fn, seed=seed)

    record = _train(case, pipe, loss_fn, step, target, with_loss=last)
    record["order"] = [n for n, _ in pipe.named_parameters()]
    record["last"] = last
    return record


def run_plain(case: Case) -> dict:
    model = model_of(case)
    if "hooks" in case.features:
        fm.add_hooks(_dense_for_hooks(case, model), list(case.hooks))
    loss_fn = loss_of(case, model)
    units = None
    if case.frontend == "from_model":
        units = {i + 1: block for i, block in enumerate(model.blocks)}

    def step(x, y, seed):
        return reference_step(model, x, y, loss_fn, chunks=case.chunks, seed=seed, units=units)

    record = _train(case, model, loss_fn, step, model, with_loss=True)
    record["order"] = [n for n, _ in model.named_parameters()]
    first: dict[int, str] = {}  # a tied tensor's every name -> its first
    record["names"] = {n: first.setdefault(id(p), n)
                       for n, p in model.named_parameters(remove_duplicate=False)}  # fmt: skip
    return record


def run_rank(rank: int, case: Case) -> dict:
    """One rank of a 2-process case (``gpipe.launch``)."""
    return run_pipe(case, rank)


# -- comparing --------------------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    worst: float = 0.0  # the largest relative error over every tensor compared
    where: str = ""
    largest: float = 0.0  # the largest |difference| of any element
    error: str | None = None  # what the pipelined run raised
    problems: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "refused" if self.error.startswith("gpipe:") else "crashed"
        return "exact" if self.worst <= TOLERANCE and not self.problems else "inexact"

    @property
    def accepted(self) -> bool:
        """Exact, or refused with gpipe's error for a feature that may be refused."""
        refusable = self.status == "refused" and any(
            REFUSABLE[f] in self.error for f in self.case.features if f in REFUSABLE
        )
        return self.status == "exact" or refusable

    def report(self) -> str:
        what = {
            "exact": f"exact (worst {self.worst:.1e})",
            "inexact": f"worst {self.worst:.3g} (|Δ| {self.largest:.3g}) at {self.where}",
            "refused": f"refused: {self.error}",
            "crashed": f"crashed: {self.error}",
        }[self.status]
        extra = f"; {'; '.join(self.problems)}" if self.problems else ""
        return f"{what}{extra}\n  {self.case.line()}"

    def note(self, where: str, actual, expected) -> None:
        if actual is None or expected is None:
            present = expected if actual is None else actual
            if present is not None and not _zero(present):  # None and zeros are alike
                side = "pipe" if actual is None else "reference"
                self._worse(float("inf"), f"{where} (None in the {side})", float("inf"))
            return
        actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
        if actual.shape != expected.shape:
            self._worse(float("inf"), f"{where} (shape {tuple(actual.shape)})", float("inf"))
            return
        largest = (actual - expected).abs().max().item() if actual.numel() else 0.0
        self._worse(relative_error(actual, expected), where, largest)

    def _worse(self, error: float, where: str, largest: float) -> None:
        self.largest = max(self.largest, largest)
        if error > self.worst or (error != error):
            self.worst, self.where = error, where


def _zero(tensor) -> bool:
    return not bool(torch.as_tensor(tensor).abs().max() > 0)


def compare(case: Case, expected: dict, records: list[dict]) -> Outcome:
    """Every tensor each rank reported against the plain run's, by (canonical) name."""
    outcome = Outcome(case)
    names = expected["names"]
    for s, plain in enumerate(expected["steps"]):
        seen = set()
        for record in records:
            ours = record["steps"][s]
            if record["last"]:
                outcome.note(f"step {s} loss", ours["loss"], plain["loss"])
            for name, grad in ours["grads"].items():
                key = names.get(name, name)
                seen.add(key)
                outcome.note(f"step {s} grad {name}", grad, plain["grads"].get(key))
            for name, buffer in ours["buffers"].items():
                outcome.note(f"step {s} buffer {name}", buffer, plain["buffers"].get(name))
        missing = set(plain["grads"]) - seen
        if missing:
            outcome.problems.append(f"step {s}: no gradient reported for {sorted(missing)}")
    for record in records:
        for name, value in record["params"].items():
            outcome.note(f"final {name}", value, expected["params"].get(names.get(name, name)))
        if record["last"] and expected["eval"] is not None:
            outcome.note("eval output", record["eval"], expected["eval"])
    if case.processes == 1 and records[0]["order"] != expected["order"]:
        outcome.problems.append("named_parameters() order differs from the model's")
    return outcome


def run_case(case: Case, timeout: float = 60.0) -> Outcome:
    """The case pipelined (1 or 2 processes) and plain, compared."""
    try:
        if case.processes == 1:
            records = [run_pipe(case)]
        else:
            records = gpipe.launch(run_rank, nprocs=2, args=(case,), timeout=timeout)
    except Exception as error:  # what the pipeline raised is the outcome
        return Outcome(case, error=_described(error))
    return compare(case, run_plain(case), records)


def _described(error: BaseException) -> str:
    """One line: what was raised ("gpipe: ..." for gpipe's own errors); for a launch, what
    each rank raised (the last line of its traceback)."""
    failures = getattr(error, "failures", None)
    if failures:
        last = {r: [line for line in text.splitlines() if line.strip()][-1]
                for r, text in sorted(failures.items())}  # fmt: skip
        text = "; ".join(f"rank {r}: {line.strip()}" for r, line in last.items())
        gpipe_error = any(line.startswith("gpipe.") for line in last.values())
    else:
        text = f"{type(error).__name__}: {error}".splitlines()[0]
        gpipe_error = type(error).__module__.startswith("gpipe")
    return f"gpipe: {text[:400]}" if gpipe_error else text[:400]


def known_gap(case: Case) -> str | None:
    """The class in issue 41 this case falls in, if it is a known failure on main."""
    where = {"any"}
    if case.schedule in SPLIT_BACKWARD:
        where.add("split")
    if case.frontend == "from_model":
        where.add("from_model")
    if case.processes == 2:
        where.add("2 processes")
    if case.remat != "never":
        where.add("remat")
    for feature in case.features:
        for place in where:
            if (feature, place) in KNOWN_GAPS:
                return f"{feature} ({place}): {KNOWN_GAPS[feature, place]}"
    return None
