"""The wire format of a message: one buffer holding a header and every tensor, aligned."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten, treespec_dumps

from gpipe.transport.codec import CodecError, encode
from gpipe.transport.framing import (
    AGREEMENT,
    ALIGN,
    HEAD,
    NOTICE,
    History,
    TensorMeta,
    flatten,
    head,
    join,
    read_head,
    row_of,
)


def test_a_packed_message_holds_every_dtype_and_shape_as_views():
    """Header and tensors in one buffer; the receiver's tensors are views of it, aligned."""
    value = (
        torch.randn(3, 5),
        {"mask": torch.rand(7) > 0.5, "positions": torch.arange(4)},
        None,
        torch.tensor(2.5, dtype=torch.float64),
        torch.empty(0, 3),
        torch.randn(2, dtype=torch.complex128),
        11,
    )
    leaves, spec = tree_flatten(value)
    described = [
        TensorMeta(x.dtype, tuple(x.shape), False) if isinstance(x, torch.Tensor) else x
        for x in leaves
    ]
    history = History()
    history.update(encode((treespec_dumps(spec), described)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    packed = join(history.parts(head(0, 7), tensors))
    assert read_head(packed) == (0, 7, 0)
    buffer = packed.clone()
    unpacked = history.unpack(buffer)
    for original, received in zip(leaves, unpacked, strict=True):
        if isinstance(original, torch.Tensor):
            assert received.dtype == original.dtype and torch.equal(received, original)
            offset = received.data_ptr() - buffer.data_ptr()
            assert (offset % ALIGN == 0 and received.data_ptr() % 16 == 0) or received.numel() == 0
        else:
            assert received == original
    alone = join(history.parts(head(NOTICE, 3, 5), None))  # in place of a packed message
    assert alone.numel() == history.decoded.size and read_head(alone) == (NOTICE, 3, 5)


def test_flatten_and_rebuild_are_pytree_s_own_for_every_kind_of_value():
    """The short path (a tensor, a list or tuple of tensors) and pytree's walk for the rest
    give the same leaves and description, and rebuild the same value."""
    t = torch.randn(2, 3)
    values = [
        t, [t], (t, t), [], (), [t, None], (t, 3), {"a": t}, [[t], t],
        torch.nn.Parameter(t.clone()), [torch.nn.Parameter(t.clone())],
    ]  # fmt: skip
    for value in values:
        leaves, text = flatten(value)
        expected_leaves, spec = tree_flatten(value)
        assert text == treespec_dumps(spec) and len(leaves) == len(expected_leaves), value
        assert all(a is b for a, b in zip(leaves, expected_leaves, strict=True)), value
        history = History()
        history.update(encode((text, [None] * len(leaves))))
        rebuilt = history.rebuild(leaves)
        assert type(rebuilt) is type(value) and tree_flatten(rebuilt)[1] == spec, value


def test_a_row_travels_in_its_frame_s_head_the_same_on_both_carriers():
    """The step's rows (seed and agreement) are frames of the one protocol: the row in the
    head, nothing after it."""
    row = torch.tensor([1.5, -2.0, float("inf")], dtype=torch.float64)
    frame = head(AGREEMENT, 9, 0, row)
    received = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    assert len(frame) == HEAD and read_head(received) == (AGREEMENT, 9, 0)
    assert torch.equal(row_of(received, torch.empty_like(row)), row)


def test_a_description_is_encoded_again_whenever_what_it_says_differs():
    """The sender keeps its last encoded description while its key stays the same: after
    good sends, a tensor of another dtype, shape or requires_grad, or a leaf of another type
    (True after 1: equal, not the same), is described anew, and a leaf that cannot cross
    processes is still refused."""
    t = torch.zeros(2, 3)
    history = History()

    def described(value):
        leaves, spec = flatten(value)
        return history.describe(spec, leaves)

    first = described((t, 1))
    assert described((torch.ones(2, 3), 1)) is first  # the same description: kept
    changed = [(t.double(), 1), (torch.zeros(3, 2), 1), (t.clone().requires_grad_(), 1),
               (t, True), (t, 1.0), [t, 1]]  # fmt: skip
    for value in changed:
        assert described(value) != first, value
        assert described((t, 1)) == first
    with pytest.raises(CodecError, match=r"torch\.device"):
        described((t, torch.device("cpu")))
    assert described((t, 1)) == first
