"""Tests for gpipe.base.microbatch: split / join / batch_size / chunk_sizes."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from gpipe.base.microbatch import batch_size, chunk_sizes, join, split

Pair = namedtuple("Pair", ["ids", "mask"])


def rows(n: int, width: int = 3) -> torch.Tensor:
    """Row i holds the value i, so a split's content shows which samples it got."""
    return torch.arange(n, dtype=torch.float32).unsqueeze(1).expand(n, width).contiguous()


def test_chunk_sizes_follow_tensor_split():
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(8, 4) == [2, 2, 2, 2]
    assert chunk_sizes(5, 5) == [1, 1, 1, 1, 1]
    assert chunk_sizes(7, 1) == [7]
    for n in range(1, 12):
        for m in range(1, n + 1):
            expected = [len(p) for p in torch.arange(n).tensor_split(m)]
            assert chunk_sizes(n, m) == expected


def test_split_tensor_uneven_and_views():
    x = rows(10)
    parts = split(x, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    assert parts[1][:, 0].tolist() == [3, 4, 5]
    for p in parts:
        assert p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view
    parts[0][0, 0] = -1.0  # writes through: no copy was made
    assert x[0, 0] == -1.0
    assert torch.equal(join(parts), x)


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: (x, y),
        lambda x, y: [x, y],
        lambda x, y: {"ids": x, "mask": y},
        lambda x, y: OrderedDict(ids=x, mask=y),
        lambda x, y: Pair(x, y),
        lambda x, y: {"pair": Pair(x, [y, "tag"]), "nested": ({"deep": x},), "n": 3},
    ],
    ids=["tuple", "list", "dict", "ordereddict", "namedtuple", "nested"],
)
def test_split_join_round_trip(make):
    x, y = rows(10), rows(10, width=5) * 2
    batch = make(x, y)
    parts = split(batch, 4)
    assert len(parts) == 4
    for part in parts:
        assert type(part) is type(batch)
    joined = join(parts)
    assert type(joined) is type(batch)
    assert _equal(joined, batch)


def test_split_keeps_namedtuple_fields_and_non_tensor_leaves():
    flag = object()
    batch = {"pair": Pair(rows(6), rows(6)), "flag": flag, "name": "train", "none": None}
    parts = split(batch, 3)
    for i, part in enumerate(parts):
        assert isinstance(part["pair"], Pair)
        assert part["pair"].ids[:, 0].tolist() == [2 * i, 2 * i + 1]
        assert part["flag"] is flag  # the very object, in every micro-batch
        assert part["name"] == "train"
        assert part["none"] is None
    joined = join(parts)
    assert joined["flag"] is flag
    assert joined["name"] == "train"


def test_split_keeps_defaultdict_and_return_types():
    dd = defaultdict(list, {"x": rows(4)})
    parts = split(dd, 2)
    assert isinstance(parts[0], defaultdict)
    assert parts[0].default_factory is list
    result = torch.max(torch.randn(4, 3, 2), dim=2)  # torch.return_types.max, not a namedtuple
    parts = split(result, 2)
    assert type(parts[0]) is type(result)
    joined = join(parts)
    assert torch.equal(joined.values, result.values)
    assert torch.equal(joined.indices, result.indices)


def test_join_takes_non_tensor_leaves_from_first_output():
    outputs = [(rows(2), "first"), (rows(2), "second")]
    assert join(outputs)[1] == "first"


def test_join_preserves_autograd():
    x = torch.randn(10, 3, requires_grad=True)
    out = join([p * 2 for p in split(x, 4)])
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_batch_size():
    assert batch_size(rows(7)) == 7
    assert batch_size({"a": rows(5), "b": [rows(5), 1.0]}) == 5


@pytest.mark.parametrize("chunks", [0, -2])
def test_split_rejects_chunks_below_one(chunks):
    with pytest.raises(ValueError, match=rf"chunks must be >= 1 \(got {chunks}\)"):
        split(rows(4), chunks)


@pytest.mark.parametrize("chunks", [2.0, "2", True, None])
def test_split_rejects_non_int_chunks(chunks):
    with pytest.raises(ValueError, match=rf"chunks must be an int \(got {chunks!r}"):
        split(rows(4), chunks)


def test_split_rejects_more_chunks_than_samples():
    with pytest.raises(ValueError, match=r"batch of 3 samples into 4 micro-batches.*chunks <= 3"):
        split(rows(3), 4)
    with pytest.raises(ValueError, match=r"inputs of 0 samples into 1 micro-batches"):
        split(torch.empty(0, 2), 1, name="inputs")


def test_split_names_mismatched_tensors():
    batch = {"ids": rows(8), "mask": rows(7)}
    with pytest.raises(
        ValueError, match=r"inputs\['ids'\] has 8 rows, inputs\['mask'\] has 7 rows"
    ):
        split(batch, 2, name="inputs")
    with pytest.raises(ValueError, match=r"batch\[1\]\.mask has 5 rows"):
        batch_size((rows(4), Pair(rows(4), rows(5))))


def test_split_rejects_batch_without_tensors():
    for batch in ([1, 2, 3], {"a": "b"}, None, ()):
        with pytest.raises(ValueError, match="batch contains no tensor"):
            split(batch, 1)


def test_split_rejects_zero_dim_tensor():
    with pytest.raises(ValueError, match=r"batch\['scale'\] is a 0-dim tensor.*Python number"):
        split({"x": rows(4), "scale": torch.tensor(2.0)}, 2)
    with pytest.raises(ValueError, match=r"^batch is a 0-dim tensor"):
        batch_size(torch.tensor(1.0))


def test_chunk_sizes_errors():
    with pytest.raises(ValueError, match=r"batch_size must be an int \(got 2.5"):
        chunk_sizes(2.5, 1)
    with pytest.raises(ValueError, match=r"batch_size must be >= 0 \(got -1\)"):
        chunk_sizes(-1, 1)
    with pytest.raises(ValueError, match=r"2 samples into 3 micro-batches"):
        chunk_sizes(2, 3)


def test_join_errors():
    with pytest.raises(ValueError, match="at least one micro-batch output"):
        join([])
    with pytest.raises(ValueError, match="expects a list of micro-batch outputs"):
        join(rows(3))
    with pytest.raises(
        ValueError, match=r"outputs\['b'\].*tensor in micro-batch 0 but a str in micro-batch 1"
    ):
        join([{"b": rows(2)}, {"b": "x"}])
    with pytest.raises(
        ValueError, match=r"keys \['a'\], micro-batch 1 has a dict with keys \['b'\]"
    ):
        join([{"a": rows(2)}, {"b": rows(2)}])
    with pytest.raises(ValueError, match=r"outputs\[0\] is a 0-dim tensor in micro-batch 0"):
        join([(torch.tensor(1.0),), (torch.tensor(2.0),)])


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b
