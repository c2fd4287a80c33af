"""What crosses processes (``gpipe.transport.codec``): plain values round-trip exactly,
anything else is refused on the sending side, and bytes that are not the codec's (a
planted pickle) are refused without running anything."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist

from gpipe.transport import inquest
from gpipe.transport.codec import VERSION, CodecError, TensorMeta, decode, encode
from gpipe.transport.framing import History

PLAIN = [
    None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**80, -(2**90), 0.1, -0.0, math.inf,
    -math.inf, "", "ünïcode\udc80", b"", b"\x00\xff", [], (), {}, [1, [2, (3,)]],
    {"a": 1, 2: "b", (3, 4): None}, torch.float32, torch.bfloat16, torch.bool,
    torch.Size([]), torch.Size([2, 0, 3]), TensorMeta(torch.int8, (4, 5), True),
]  # fmt: skip


class Marker:
    """Unpickling it creates the file ``path``: the proof that something ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_plain_values_round_trip_with_their_types():
    for value in PLAIN:
        back = decode(encode(value))
        assert type(back) is type(value) and back == value, value
    back = decode(encode([math.nan]))[0]
    assert math.isnan(back)
    assert decode(encode(PLAIN)) == PLAIN
    assert encode(PLAIN)[0] == VERSION


def test_subclasses_of_int_float_and_str_travel_as_their_base_type():
    from enum import IntEnum

    class Small(IntEnum):
        ONE = 1

    assert decode(encode([Small.ONE, True])) == [1, True]
    assert type(decode(encode(Small.ONE))) is int


@pytest.mark.parametrize(
    "value, named",
    [(object(), "object"), ({"x": [torch.zeros(1)]}, "torch.Tensor"), ({1, 2}, "set"),
     (torch.device("cpu"), "torch.device"), (Marker("x"), "Marker")],
)  # fmt: skip
def test_anything_else_is_refused_on_the_sending_side_with_the_remedy(value, named):
    with pytest.raises(CodecError, match=f"the memory report holds a .*{named}.*cannot cross"):
        encode(value, "the memory report")


def test_a_value_that_holds_itself_is_refused_not_a_recursion_error():
    loop = []
    loop.append(loop)
    with pytest.raises(CodecError, match="nested more than"):
        encode(loop)


def test_bytes_that_are_not_the_codecs_are_refused(tmp_path):
    marker = tmp_path / "ran"
    planted = pickle.dumps(Marker(str(marker)))
    good = encode({"a": [1, 2.5, "x"]})
    v = bytes([VERSION])
    bad = [v + b"Z", v + b"l\xff\xff\xff\xff", v + b"y\x03\x00\x00\x00os.",
           v + b"d\x01\x00\x00\x00l\x00\x00\x00\x00N"]  # fmt: skip
    for data in (planted, b"", good[:-1], good + b"\x00", *bad):
        with pytest.raises(CodecError, match="not gpipe's wire format"):
            decode(data)
    assert not marker.exists()


def test_a_planted_description_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    planted = pickle.dumps(("spec", [Marker(str(marker))]))
    history = History()
    history.update(planted)
    with pytest.raises(CodecError):
        history.decoded  # noqa: B018 (the property decodes)
    assert not marker.exists()


def test_a_tree_spec_naming_an_enum_is_refused_on_both_sides():
    """Loading it would import the module it names."""
    spec = '[1, {"type": "builtins.dict", "context": "[{\\"__enum__\\": true}]"}]'
    with pytest.raises(CodecError, match="enum"):
        History().describe(spec, [])
    history = History()
    history.update(encode((spec, [])))
    with pytest.raises(CodecError, match="enum"):
        history.decoded  # noqa: B018


def test_a_statement_planted_in_the_store_runs_nothing_and_is_ignored(tmp_path, monkeypatch):
    """Another local user wrote a pickle under rank 1's key of the inquest (the store takes
    any connection): rank 0's inquest ignores it, with a warning, and names rank 1 silent."""
    store = dist.HashStore()
    monkeypatch.setattr(inquest, "_store", lambda: store)
    monkeypatch.setattr(inquest, "_last_blame", {})
    monkeypatch.setattr(inquest, "_gone", [])
    marker = tmp_path / "ran"
    store.set("gpipe/inquest/1", pickle.dumps(Marker(str(marker))))
    with pytest.warns(RuntimeWarning, match="something else than rank 1's statement"):
        verdict = inquest.blame(0, [1], "rank 0 waited", timeout=0.4)
    assert verdict.silent == [1] and not verdict.failed
    assert not marker.exists()
