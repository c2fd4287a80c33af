"""Record how a factory builds a model on ``meta``; replay exactly what one rank needs.

:func:`record` runs ``factory()`` on ``meta`` under a ``TorchDispatchMode`` that writes down, in
order, every aten operation that creates a tensor or writes one, with its arguments. Tensors are
named by their *storage*, so views, ``.data``, ``nn.Parameter`` wrapping and ties need no special
case: every tensor argument is a :class:`TensorRef` (storage, size, stride, offset, dtype).

:meth:`Recording.replay` then plans backwards from the storages a rank keeps: an operation runs
for real if it writes a storage still needed (then every storage it reads is needed too); a random
operation that writes nothing needed runs on a scratch tensor of the same shape, stride and dtype,
freed at once, so that the generator advances exactly as in eager construction; anything else is
skipped. Random draws after the last one that matters are skipped too. Generator changes that the
factory makes itself (``torch.manual_seed``, ``set_rng_state``, ``fork_rng``) are noticed at the
next draw and replayed. ``torch.tensor(data)``, which bypasses the dispatcher on meta, is made
on the CPU and moved to meta by a recorded copy. The ``nn.init`` functions that return at once on
meta are recorded as whole calls while the factory runs (``gpipe.materialize.init_calls``).
gpipe.materialize states the contract and names the tensors in errors.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from gpipe.base.rng import device_generator
from gpipe.materialize.init_calls import InitCall, init_functions_recorded
from gpipe.materialize.operations import info_of, leaves, map_leaves, written_by

__all__ = ["Recording", "TensorRef", "Unreplayable", "record"]

_aten = torch.ops.aten
# Operations that hand a tensor's value to Python, which then decides what the factory does.
_READS_TO_PYTHON = {
    getattr(_aten, n).default for n in ("_local_scalar_dense", "is_nonzero", "equal")
}
# Their first argument lends only its shape, dtype and device.
_SHAPE_ONLY_FIRST = {
    *("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"),
    *("randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"),
}
# Random operations whose draws depend on their inputs' shapes only, not their values.
_DRAWS_BY_SHAPE = {"native_dropout", "bernoulli", "normal", *("rand_like", "randn_like")}
_LITERALS = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor as an operation saw it: a view of storage ``key``."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device  # as recorded: meta, or a real device the factory named


@dataclass(slots=True)
class _Storage:
    holder: torch.Tensor  # keeps the storage (and so its key) alive during the record
    born: int | None  # index of the operation that created it; None: made outside the record
    snapshot: torch.UntypedStorage | None = None  # a real outside storage, before its first write


@dataclass(slots=True)
class _Op:
    # Small on purpose: a record holds one per operation of the *whole* model in every
    # process, and what it leaves in the allocator stays resident (tuples, not sets).
    func: Any
    args: tuple
    kwargs: dict
    outs: tuple[TensorRef | None, ...]  # flattened outputs
    reads: tuple[int, ...]  # storages whose values it uses
    draw_reads: tuple[int, ...]  # of those, the ones a random draw's amount may depend on
    writes: tuple[int, ...]  # storages it creates or writes
    generator: torch.Generator | None = None  # the generator it draws from, if random
    # Set before it: (generator, restored to its state after op i, or None: set to bytes).
    events: tuple[tuple[torch.Generator, int | None, bytes | None], ...] = ()


class Recording:
    """The operations of one ``factory()`` call on meta; see :meth:`replay`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ops: list[_Op] = []
        self.storages: list[_Storage] = []
        self._keys: dict[int, int] = {}
        self._tainted: set[int] = set()  # storages holding values derived from random draws
        # Generator states by digest (a CPU state is 5 KB, and there is one per draw).
        self._expected: dict[int, bytes] = {}  # generator -> its state after our last look
        self._boundaries: dict[int, dict[bytes, int]] = {}  # generator -> state -> after op i
        self._interned: dict[TensorRef, TensorRef] = {}  # equal refs shared by all ops

    def key_of(self, tensor: torch.Tensor) -> int | None:
        """The storage key of a tensor seen during the record (None: never seen)."""
        return self._keys.get(tensor.untyped_storage()._cdata)

    def is_outside_meta(self, key: int) -> bool:
        """A meta storage no recorded operation created: its contents are unknown."""
        storage = self.storages[key]
        return storage.born is None and storage.holder.device.type == "meta"

    # -- recording --------------------------------------------------------------------------

    def _ref(self, tensor: torch.Tensor, born: int | None) -> TensorRef:
        cdata = tensor.untyped_storage()._cdata
        key = self._keys.get(cdata)
        if key is None:
            key = self._keys[cdata] = len(self.storages)
            self.storages.append(_Storage(tensor, born))
        shape, stride, offset = tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
        ref = TensorRef(key, shape, stride, offset, tensor.dtype, tensor.device)
        return self._interned.setdefault(ref, ref)

    def _refs(self, tree: Any) -> Any:
        return map_leaves(lambda x: self._ref(x, None) if isinstance(x, torch.Tensor) else x, tree)

    def _watch(self, generator: torch.Generator) -> None:
        digest = _digest(generator.get_state().numpy().tobytes())
        self._expected[id(generator)] = digest
        self._boundaries.setdefault(id(generator), {})[digest] = len(self.ops) - 1

    def _before_draw(self, generator: torch.Generator) -> tuple:
        """An event if the factory changed the generator since our last look."""
        state = generator.get_state().numpy().tobytes()
        digest = _digest(state)
        if self._expected.get(id(generator)) == digest:
            return ()
        earlier = self._boundaries.get(id(generator), {}).get(digest)
        if earlier is not None:  # restored to a state it had after draw `earlier`
            return ((generator, earlier, None),)
        return ((generator, None, state),)

    def _after_draw(self, generator: torch.Generator) -> None:
        # Meta draws consume nothing, so states would repeat and restores be ambiguous: one
        # real draw makes every point of the record distinct. It is not recorded.
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            torch.empty(1, device=generator.device).uniform_(generator=generator)
        self._watch(generator)

    def _observe(self, func: Any, args: tuple, kwargs: dict) -> Any:
        info = info_of(func)
        inputs = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _READS_TO_PYTHON and any(self.key_of(t) in self._tainted for t in inputs):
            raise ValueError(
                f"factory() reads a randomly drawn value back into Python ({func}, e.g. .item()); "
                f"build() records factory() on meta, where draws differ from eager ones, so it "
                f"cannot reproduce what the factory does with it. Build the model in one process "
                f"and pass it to Pipe instead"
            )
        written = written_by(info, args, kwargs)
        random = info.random
        generator, events = None, ()
        if random:
            generator = kwargs.get("generator") or next(
                (a for a in args if isinstance(a, torch.Generator)), None
            )
            if generator is None:
                first = next(iter(written or inputs), None)
                device = kwargs.get("device") or (first.device if first is not None else None)
                generator = device_generator(self.replay_device(torch.device(device or "cpu")))
            events = self._before_draw(generator)
        refs = self._refs((args, kwargs))
        for tensor in written:
            storage = self.storages[self.key_of(tensor)]
            if storage.born is None and storage.snapshot is None and not tensor.is_meta:
                storage.snapshot = tensor.untyped_storage().clone()  # replay must start here

        out = func(*args, **kwargs)

        index = len(self.ops)
        flat_out = leaves(out)
        outs = tuple(self._ref(t, index) if isinstance(t, torch.Tensor) else None for t in flat_out)
        fresh = {r.key for r in outs if r is not None and self.storages[r.key].born == index}
        writes = fresh | {self.key_of(t) for t in written}
        if not writes and not random:
            return out  # a view or a query: replay rebuilds views from their storage
        args, kwargs = refs
        if not inputs and len(fresh) == 1 and kwargs.get("dtype") is None and info.dtype_kwarg:
            kwargs = {**kwargs, "dtype": flat_out[0].dtype}  # not the default dtype of replay
        name = info.name
        reads = {r.key for r in leaves((args, kwargs)) if isinstance(r, TensorRef)}
        if name in _SHAPE_ONLY_FIRST and args and isinstance(args[0], TensorRef):
            reads.discard(args[0].key)
        written_keys = {self.key_of(t) for t in written}
        by_shape = name in _DRAWS_BY_SHAPE or not (reads - written_keys)
        draw_reads = () if by_shape else tuple(reads - written_keys)
        if random or reads & self._tainted:
            self._tainted |= writes
        reads, writes = tuple(reads), tuple(writes)
        self.ops.append(_Op(func, args, kwargs, outs, reads, draw_reads, writes, generator, events))
        if random:
            self._after_draw(generator)
        return out

    def observe_call(self, call: InitCall, tensor: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        generator, events = None, ()
        if call.random:
            bound = inspect.signature(call.fn).bind(tensor, *args, **kwargs).arguments
            generator = bound.get("generator")
            generator = generator or device_generator(self.replay_device(tensor.device))
            events = self._before_draw(generator)
            self._tainted.add(self._ref(tensor, None).key)
        ref, args, kwargs = self._refs((tensor, args, kwargs))
        keys = (ref.key,)
        self.ops.append(_Op(call, (ref, *args), kwargs, (None,), keys, (), keys))
        self.ops[-1].generator, self.ops[-1].events = generator, events
        if call.random:
            self._after_draw(generator)
        return tensor

    def replay_device(self, device: torch.device) -> torch.device:
        return self.device if device.type == "meta" else device

    # -- replay -----------------------------------------------------------------------------

    def _plan(self, keep: dict[int, str]) -> list[tuple[str, frozenset[int], str] | None]:
        """Backwards: ("real" | "draw", storages used for real, label) or None per op."""
        needed = dict(keep)  # storage -> the kept tensor that needs it (for errors)
        relevant: dict[int, str] = {}  # generator -> a kept tensor a later draw of it makes
        restored = {id(g) for op in self.ops for g, at, _ in op.events if at is not None}
        plan: list[tuple[str, frozenset[int], str] | None] = [None] * len(self.ops)
        for i in reversed(range(len(self.ops))):
            op = self.ops[i]
            hit = [k for k in op.writes if k in needed]
            gen = id(op.generator) if op.generator is not None else None
            if hit:
                label, uses = needed[hit[0]], frozenset(op.reads) | frozenset(hit)
                if gen is not None:
                    relevant[gen] = label
                plan[i] = ("real", uses, label)
            elif gen is not None and (gen in relevant or gen in restored):
                label = relevant.get(gen, "the draws of the local tensors")
                uses = frozenset(op.draw_reads)
                plan[i] = ("draw", uses, label)
            else:
                uses = frozenset()
            for key in uses:
                if self.is_outside_meta(key):
                    why = f"is computed (by {op.func}) from a meta tensor made outside factory()"
                    raise Unreplayable(label, why)
                needed.setdefault(key, label)
            for generator, at, _ in op.events:
                if at is None:
                    relevant.pop(id(generator), None)  # the draws before it no longer matter
        return plan

    def replay(self, keep: dict[int, str], seed: int) -> dict[int, torch.UntypedStorage]:
        """Run what is needed for storages ``keep`` (key -> label), the generators of the target
        device and the CPU seeded with ``seed``; return those storages, on the target device.

        Raises:
            Unreplayable: a kept storage cannot be reproduced (carries the label).
        """
        for key, label in keep.items():
            if self.is_outside_meta(key):
                raise Unreplayable(label, "was not created by an operation inside factory()")
        plan = self._plan(keep)
        last_use: dict[int, float] = {key: float("inf") for key in keep}
        for i, step in enumerate(plan):
            for key in step[1] if step else ():
                last_use[key] = max(last_use.get(key, -1), i)
        restore_points = {
            (id(g), at) for op in self.ops for g, at, _ in op.events if at is not None
        }
        saved: dict[tuple[int, int], torch.Tensor] = {}
        for generator in _default_generators(self.device):
            generator.manual_seed(seed)
            if (id(generator), -1) in restore_points:
                saved[id(generator), -1] = generator.get_state()
        env: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad():
            for i, (op, step) in enumerate(zip(self.ops, plan, strict=True)):
                for generator, at, state in op.events:
                    if at is not None:
                        generator.set_state(saved[id(generator), at])
                    else:
                        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
                if step is None:
                    continue
                _, uses, label = step
                try:
                    self._run(op, uses, env, i)
                except Exception as error:
                    why = f"could not be rebuilt: replaying {op.func} on {self.device} failed"
                    raise Unreplayable(label, f"{why}: {error}") from error
                if op.generator is not None and (id(op.generator), i) in restore_points:
                    saved[id(op.generator), i] = op.generator.get_state()
                for key in uses:
                    if last_use.get(key) == i:
                        env.pop(key, None)
        return {key: env[key] for key in keep}

    def _run(self, op: _Op, uses: frozenset[int], env: dict, index: int) -> None:
        def real(x: Any) -> Any:
            if isinstance(x, torch.device) and x.type == "meta":
                return self.device
            if not isinstance(x, TensorRef):
                return x
            device = self.replay_device(x.device)
            if x.key not in uses:  # written but not needed, or lends only its shape
                return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device=device)
            if x.key not in env:  # a real tensor from outside the record: read it as it was
                outside = self.storages[x.key]
                if outside.born is not None:
                    raise RuntimeError(f"internal error: storage {x.key} was freed or never made")
                snapshot = outside.snapshot
                env[x.key] = outside.holder.untyped_storage() if snapshot is None else snapshot
            storage = env[x.key]
            return torch.empty(0, dtype=x.dtype, device=storage.device).set_(
                storage, x.offset, x.size, x.stride
            )

        args, kwargs = map_leaves(real, (op.args, op.kwargs))
        out = leaves(op.func(*args, **kwargs))
        for ref, tensor in zip(op.outs, out, strict=True):
            born_here = ref is not None and self.storages[ref.key].born == index
            if born_here and ref.key in uses and ref.key not in env:
                if (
                    tensor.dtype != ref.dtype
                    or tuple(tensor.shape) != ref.size
                    or any(
                        n > 1 and a != b
                        for n, a, b in zip(ref.size, tensor.stride(), ref.stride, strict=True)
                    )
                ):
                    raise ValueError(
                        f"meta and {tensor.device} disagree on the layout of its output: "
                        f"{ref.size}/{ref.stride} on meta, {tuple(tensor.shape)}/"
                        f"{tensor.stride()} for real"
                    )
                env[ref.key] = tensor.untyped_storage()


class Unreplayable(ValueError):
    def __init__(self, label: str, reason: str) -> None:
        super().__init__(f"{label} {reason}")
        self.label, self.reason = label, reason


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recording._observe(func, tuple(args), dict(kwargs or {}))


class _Literals(TorchFunctionMode):
    """``torch.tensor(data)`` on meta bypasses the dispatcher, losing ``data``: make it on the
    CPU, then move it to meta by an operation the recorder sees."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LITERALS:
            method = func is torch.Tensor.new_tensor
            data = args[1] if method else args[0] if args else None
            device = kwargs.get("device") or (args[0].device if method else None)
            on_meta = device is not None and torch.device(device).type == "meta"
            if on_meta and not isinstance(data, torch.Tensor):
                requires_grad = kwargs.pop("requires_grad", False)
                on_cpu = func(*args, **{**kwargs, "device": "cpu"})
                return on_cpu.to("meta").requires_grad_(requires_grad)
        return func(*args, **kwargs)


def record(factory: Callable[[], Any], *, seed: int, device: torch.device) -> tuple[Any, Recording]:
    """Call ``factory()`` on meta, recording it; the CPU's and ``device``'s generators are
    seeded with ``seed`` (the caller restores them)."""
    recording = Recording(device)
    for generator in _default_generators(device):
        generator.manual_seed(seed)
        recording._watch(generator)
    with (
        init_functions_recorded(recording),
        _Literals(),
        torch.device("meta"),
        _Recorder(recording),
    ):
        model = factory()
    return model, recording


def _default_generators(device: torch.device) -> list[torch.Generator]:
    """The generators eager construction on ``device`` draws from, each once."""
    return list({id(g): g for g in (torch.default_generator, device_generator(device))}.values())


def _digest(state: bytes) -> bytes:
    """A generator state's fingerprint: equal states, equal digests (collisions: 2**-128)."""
    return hashlib.blake2b(state, digest_size=16).digest()
