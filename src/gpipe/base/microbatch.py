"""Split a mini-batch into micro-batches along dim 0, and join outputs back.

A batch is a tensor or a nested tuple/list/dict of tensors (namedtuples and ``torch.return_types``
keep their type). Every tensor in a batch shares dim 0, the batch dimension; anything that is not a
tensor, tuple, list or dict (a flag, a string, ``None``) is a constant that every micro-batch
receives unchanged.

Sizes follow :func:`torch.tensor_split`: a batch of 10 in 4 chunks gives 3, 3, 2, 2. Since the
micro-batches differ in size, a mean-reduced loss must be weighted by ``size / batch_size`` (not
``1 / chunks``) for the summed micro-batch gradients to equal the full-batch gradient.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["batch_size", "chunk_sizes", "join", "split"]

# A leaf is reported by its path from the root, e.g. "batch['ids']" or "batch[0].mask".
_Leaf = tuple[str, Any]


def chunk_sizes(batch_size: int, chunks: int) -> list[int]:
    """Sizes of the ``chunks`` micro-batches of a batch of ``batch_size`` samples.

    The first ``batch_size % chunks`` micro-batches get one sample more, as in
    :func:`torch.tensor_split`.

    Example::

        >>> chunk_sizes(10, 4)
        [3, 3, 2, 2]
    """
    _check_int("batch_size", batch_size)
    _check_chunks(chunks)
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0 (got {batch_size})")
    if chunks > batch_size:
        raise ValueError(
            f"cannot split a batch of {batch_size} samples into {chunks} micro-batches: "
            f"every micro-batch needs at least one sample; use chunks <= {batch_size} "
            f"or a larger batch"
        )
    base, extra = divmod(batch_size, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


def batch_size(batch: Any, *, name: str = "batch") -> int:
    """Number of samples in ``batch``: the common leading dimension of its tensors.

    ``name`` is how error messages call the batch (e.g. ``"inputs"``).

    Example::

        >>> batch_size({"ids": torch.zeros(8, 16), "mask": torch.ones(8, 16), "train": True})
        8

    Raises:
        ValueError: if the batch holds no tensor, holds a 0-dim tensor, or its tensors disagree
            on dim 0.
    """
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:  # the common case, at once
        return batch.shape[0]
    return _batch_size(_tensor_leaves(batch, name), name)


def split(batch: Any, chunks: int, *, name: str = "batch") -> list[Any]:
    """Split ``batch`` into ``chunks`` micro-batches along dim 0.

    Each micro-batch has the structure of ``batch``; its tensors are views of the batch's tensors
    (no copy) and its non-tensor leaves are the batch's own objects. ``name`` is how error
    messages call the batch.

    Example::

        >>> mbs = split({"ids": torch.arange(10), "train": True}, 4)
        >>> [mb["ids"].tolist() for mb in mbs]
        [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
        >>> mbs[3]["train"]
        True

    Raises:
        ValueError: if ``chunks`` is not an int >= 1 or exceeds the batch size, or if the batch
            is invalid as described in :func:`batch_size`.
    """
    _check_chunks(chunks)
    size = _batch_size(_tensor_leaves(batch, name), name)
    if chunks > size:
        raise ValueError(
            f"cannot split {name} of {size} samples into {chunks} micro-batches: every "
            f"micro-batch needs at least one sample; use chunks <= {size} or a larger batch"
        )
    sizes = chunk_sizes(size, chunks)

    def pieces(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor):
            return list(x.split(sizes))  # views along dim 0
        return [x] * chunks

    return _transpose_map(batch, pieces, chunks)


def join(outputs: Sequence[Any], *, name: str = "outputs") -> Any:
    """Concatenate micro-batch outputs along dim 0: the inverse of :func:`split`.

    All outputs must share one structure. A non-tensor leaf is taken from the first output
    (micro-batches are expected to agree on constants; they are not compared).

    Example::

        >>> x = torch.arange(10)
        >>> torch.equal(join(split((x, "tag"), 4))[0], x)
        True

    Raises:
        ValueError: if ``outputs`` is empty, the outputs differ in structure, or a tensor leaf
            is 0-dim (it has no dim 0 to concatenate along).
    """
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, Sequence):
        raise ValueError(
            f"join expects a list of micro-batch outputs (got {type(outputs).__name__}); "
            f"pass e.g. [model(mb) for mb in split(batch, chunks)]"
        )
    if len(outputs) == 0:
        raise ValueError("join needs at least one micro-batch output (got an empty sequence)")
    return _join(list(outputs), name)


# --- helpers -------------------------------------------------------------------------------------


def _check_int(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int (got {value!r} of type {type(value).__name__})")


def _check_chunks(chunks: Any) -> None:
    _check_int("chunks", chunks)
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1 (got {chunks}); use chunks=1 to not split")


def _children(x: Any, path: str) -> list[tuple[str, Any]] | None:
    """(path, child) pairs of a container, or None for a leaf."""
    if isinstance(x, dict):
        return [(f"{path}[{k!r}]", v) for k, v in x.items()]
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):  # namedtuple
        return [(f"{path}.{f}", v) for f, v in zip(type(x)._fields, x, strict=True)]
    if isinstance(x, tuple | list):
        return [(f"{path}[{i}]", v) for i, v in enumerate(x)]
    return None


def _rebuild(template: Any, values: list[Any]) -> Any:
    """A container of ``template``'s type and keys holding ``values``."""
    if isinstance(template, dict):
        pairs = zip(template.keys(), values, strict=True)
        if isinstance(template, defaultdict):
            return type(template)(template.default_factory, pairs)
        return type(template)(pairs)
    if isinstance(template, tuple) and hasattr(type(template), "_fields"):
        return type(template)(*values)
    return type(template)(values)  # also tuple/list subclasses, e.g. torch.return_types.max


def _tensor_leaves(batch: Any, name: str) -> list[_Leaf]:
    leaves: list[_Leaf] = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            leaves.append((path, x))
            return
        children = _children(x, path)
        for child_path, child in children or ():
            walk(child, child_path)

    walk(batch, name)
    return leaves


def _batch_size(leaves: list[_Leaf], name: str) -> int:
    if not leaves:
        raise ValueError(
            f"{name} contains no tensor to split along the batch dimension; pass a tensor or "
            f"a tuple/list/dict holding at least one tensor"
        )
    for path, t in leaves:
        if t.dim() == 0:
            raise ValueError(
                f"{path} is a 0-dim tensor, so it has no batch dimension to split; pass it as a "
                f"Python number (constants go to every micro-batch) or give it one row per sample"
            )
    sizes = {t.shape[0] for _, t in leaves}
    if len(sizes) > 1:
        rows = ", ".join(f"{path} has {t.shape[0]} rows" for path, t in leaves)
        raise ValueError(
            f"tensors in {name} disagree on the batch size (dim 0): {rows}; every tensor needs "
            f"one row per sample (pass per-batch constants as non-tensors or expand them)"
        )
    return sizes.pop()


def _transpose_map(batch: Any, pieces: Callable[[Any], list[Any]], chunks: int) -> list[Any]:
    """Turn one structure of leaves into ``chunks`` structures, leaf i -> pieces(leaf)[i]."""
    if isinstance(batch, torch.Tensor):
        return pieces(batch)
    children = _children(batch, "")
    if children is None:
        return pieces(batch)
    per_child = [_transpose_map(child, pieces, chunks) for _, child in children]
    return [_rebuild(batch, [parts[i] for parts in per_child]) for i in range(chunks)]


def _join(outputs: list[Any], path: str) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        for i, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor):
                raise ValueError(
                    f"{path} is a tensor in micro-batch 0 but a {type(out).__name__} in "
                    f"micro-batch {i}; every micro-batch must return the same structure"
                )
            if out.dim() == 0:
                raise ValueError(
                    f"{path} is a 0-dim tensor in micro-batch {i}, which cannot be concatenated "
                    f"along dim 0; return one row per sample, or reduce per micro-batch yourself "
                    f"(e.g. torch.stack)"
                )
        return torch.cat(outputs)
    children = _children(first, path)
    if children is None:
        return first  # constants: trust the first micro-batch
    keys = _shape_of(first)
    for i, out in enumerate(outputs[1:], start=1):
        if type(out) is not type(first) or _shape_of(out) != keys:
            raise ValueError(
                f"{path} differs between micro-batches: micro-batch 0 has {_describe(first)}, "
                f"micro-batch {i} has {_describe(out)}; every micro-batch must return the same "
                f"structure"
            )
    columns = [_children(out, path) or [] for out in outputs]
    joined = [
        _join([col[j][1] for col in columns], child_path)
        for j, (child_path, _) in enumerate(children)
    ]
    return _rebuild(first, joined)


def _shape_of(x: Any) -> Any:
    """What must match between micro-batches: dict keys or sequence length."""
    return list(x.keys()) if isinstance(x, dict) else len(x)


def _describe(x: Any) -> str:
    if isinstance(x, dict):
        return f"a {type(x).__name__} with keys {list(x.keys())}"
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"a {type(x).__name__}"
