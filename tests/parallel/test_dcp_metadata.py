"""gpipe.parallel.dcp_metadata: DCP's .metadata read by walking its opcodes, never unpickled.
What it builds equals what torch's own reader (pickle.load) returns, field by field and type
by type, for real checkpoints and for every shape DCP writes; anything else is refused in one
line naming the file and what it holds, and nothing it names runs."""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import pickletools
import random

import pytest
import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from gpipe.parallel import dcp_metadata
from gpipe.parallel.dcp import read_metadata
from gpipe.parallel.dcp_metadata import DcpFailure, Refused, parse
from saved_checkpoints import make_model, save

MD = md.__name__.encode()


def same(mine, theirs, where="metadata"):
    """``mine`` equals ``theirs`` in every field, item and key, each of the same type."""
    assert type(mine) is type(theirs), (where, type(mine), type(theirs))
    if isinstance(mine, dict):
        assert len(mine) == len(theirs), where
        for (k, v), (k2, v2) in zip(mine.items(), theirs.items(), strict=True):
            same(k, k2, f"{where} key {k!r}")
            same(v, v2, f"{where}[{k!r}]")
    elif isinstance(mine, list | tuple):
        assert len(mine) == len(theirs), where
        for i, (x, y) in enumerate(zip(mine, theirs, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(mine):
        for field in dataclasses.fields(mine):
            same(getattr(mine, field.name), getattr(theirs, field.name), f"{where}.{field.name}")
    else:
        assert mine == theirs, (where, mine, theirs)


def test_a_checkpoint_with_optimizer_state_and_rng_reads_as_torch_reads_it(tmp_path):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    saved = optimizer.state_dict()  # tensors (exp_avg, the step count) and objects (lr, betas)
    state = {"state": {names[i]: v for i, v in saved["state"].items()},
             "param_groups": [{**g, "params": names} for g in saved["param_groups"]]}  # fmt: skip
    folder = save(tmp_path, 1, model, optimizer=state, rng={0: torch.get_rng_state()})
    mine, data = read_metadata(folder), (folder / ".metadata").read_bytes()
    same(mine, pickle.loads(data))
    assert {op.name for op, _, _ in pickletools.genops(data)} <= dcp_metadata.OPCODES
    kinds = {type(entry) for entry in mine.state_dict_metadata.values()}
    assert kinds == {md.TensorStorageMetadata, md.BytesStorageMetadata}


def test_a_k2_runs_checkpoints_read_as_torch_reads_them(tiny_run):
    out, _ = tiny_run
    folders = sorted((out / "checkpoints").glob("step-*"))
    assert folders
    for folder in folders:  # two ranks' files; replicas, shards, LoRA: test_train_job, test_lora
        same(read_metadata(folder), pickle.loads((folder / ".metadata").read_bytes()))


def every_shape() -> md.Metadata:
    """A Metadata with each shape DCP writes: a tensor in chunks (a sharded replica's), long
    names, offsets past 2**31, flags set, a one-item dict, object paths through lists."""
    long = "model." + "layer." * 60 + "weight"  # over 255 bytes
    props = md.TensorProperties(torch.bfloat16, requires_grad=True, pin_memory=True,
                                memory_format=torch.channels_last)  # fmt: skip
    chunks = [md.ChunkStorageMetadata(torch.Size([i * 4, 0]), torch.Size([4, 6])) for i in range(3)]
    storage = {md.MetadataIndex(long, [4 * i, 0], i): _StorageInfo("__1_0.distcp", 3 << 31, 96)
               for i in range(3)}  # fmt: skip
    storage[md.MetadataIndex("opt.lr")] = _StorageInfo("__0_0.distcp", 7, 70000, ["t"])
    return md.Metadata(
        state_dict_metadata={long: md.TensorStorageMetadata(props, torch.Size([12, 6]), chunks),
                             "opt.lr": md.BytesStorageMetadata()},
        planner_data={long: ("model", long[6:]), "opt.lr": ("opt", "groups", 0, "lr")},
        storage_data=storage,
        storage_meta=md.StorageMeta(pathlib.PosixPath("/r/step-1.tmp"), "id", None, ["m"]),
        version="1.0.0",
    )  # fmt: skip


ONE_KEY = md.Metadata(
    {"w": md.BytesStorageMetadata()}, planner_data={"w": ("w",)},
    storage_data={md.MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 1)},
)  # fmt: skip


def test_every_shape_dcp_writes_reads_as_torch_reads_it():
    used = set()
    for metadata in (every_shape(), ONE_KEY):
        data = pickle.dumps(metadata)  # as DCP's FileSystemWriter writes it
        same(parse(data, "x"), pickle.loads(data))
        used |= {op.name for op, _, _ in pickletools.genops(data)}
    assert {"APPENDS", "SETITEM", "BINUNICODE", "LONG1", "NEWTRUE", "BININT"} <= used
    assert used <= dcp_metadata.OPCODES


def _str(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


def _global(module: bytes, name: str) -> bytes:
    return _str(module.decode()) + _str(name) + b"\x93"


EMPTY = b"\x80\x04" + _global(MD, "Metadata") + b")\x81}" + _str("state_dict_metadata")
EMPTY += b"}sb."  # Metadata(state_dict_metadata={}): the least DCP's metadata is


@pytest.mark.parametrize(
    ("data", "refused"),
    [
        (b"\x80\x04" + _global(b"pathlib", "Path.touch") + _str("/tmp/m") + b"\x85R.",
         r"x refers to pathlib\.Path\.touch, which a DCP checkpoint never holds \(at byte 23\): "
         r"refusing to read it; use another checkpoint"),
        (b"\x80\x04" + _global(b"os", "sys\x1b[2Jtem") + b"N\x85R.",  # os.system(None)
         r"refers to 'os\.sys\\x1b\[2Jtem', which"),
        (b"\x80\x04" + _global(MD, "Metadata") + b"}\x85R.",
         r"applies REDUCE to torch\.distributed\.checkpoint\.metadata\.Metadata, which"),
        (b"\x80\x04" + _global(b"torch", "Size") + b")\x81.", r"applies NEWOBJ to torch\.Size"),
        (b"\x80\x04" + _global(b"torch", "Size") + b"K\x01\x85R.", r"REDUCE at byte 19 fails"),
        (b"\x80\x04" + _global(b"torch", "float32") + b"N\x85R.", r"REDUCE to torch\.float32"),
        (b"\x80\x04cos\nsystem\nN\x85R.", r"holds the pickle opcode GLOBAL, which DCP's"),
        (EMPTY[:-2] + b"\x8c\x04evil\x88sb.", r"builds a Metadata whose evil is not DCP's"),
        (b"\x80\x04" + b"(" * 17, r"nests more than 16 marks"),
        (b"\x80\x04(" + b"K\x00" * 65 + b"t.", r"a tuple of 65 items"),
        (b"\x80\x04)\x85\x85\x85.", r"or tuples 3 deep"),
        (b"\x80\x04]\x94h\x00.", r"shares a list through the memo"),
        (b"\x80\x04j\xff\xff\xff\x7f.", r"LONG_BINGET at byte 2 fails"),
        (EMPTY + b"N", r"1 bytes follow its end"),
    ],
    ids=["a global outside the schema", "named without control characters", "REDUCE on a type",
         "NEWOBJ on a callable", "torch.Size of an int", "REDUCE on a dtype", "protocol 0",
         "a field DCP has not", "deep marks", "a long tuple", "deep tuples", "a shared list",
         "a memo slot never stored", "bytes after STOP"],
)  # fmt: skip
def test_what_dcp_never_writes_is_refused_by_name(data, refused):
    with pytest.raises(Refused, match=refused):
        parse(data, "x")


def test_building_a_class_is_refused_and_leaves_it_alone():
    # StorageMeta itself, then BUILD with (None, {"evil": "boom"}): pickle would set its attribute.
    data = b"\x80\x04" + _global(MD, "StorageMeta") + b"N}" + _str("evil") + _str("boom")
    with pytest.raises(Refused, match=r"applies BUILD to torch\..*\.StorageMeta, which DCP's"):
        parse(data + b"s\x86b.", "x")
    assert not hasattr(md.StorageMeta, "evil")
    assert pickle.loads(EMPTY) == parse(EMPTY, "x") == md.Metadata({})


def test_a_truncated_or_overlong_file_is_damaged_not_read(tmp_path, monkeypatch):
    data = pickle.dumps(every_shape())
    for cut in (1, 40, len(data) // 2, len(data) - 1):
        with pytest.raises(DcpFailure, match=r"cannot read x \(damaged\?\)"):
            parse(data[:cut], "x")
    huge = b"\x80\x04X\xff\xff\xff\x7f" + b"a" * 16  # a string of 2 GiB, claimed
    with pytest.raises(DcpFailure, match=r"expected 2147483647 bytes in a unicodestring4"):
        parse(huge, "x")
    monkeypatch.setattr(dcp_metadata, "MAX_BYTES", len(data) - 1)
    with pytest.raises(Refused, match=rf"holds over {len(data) - 1} bytes of metadata"):
        parse(data, "x")


def test_a_damaged_file_is_refused_or_read_never_anything_else(tmp_path):
    """Bytes flipped anywhere in a real file: each read raises DcpFailure (damaged or
    refused) or returns a Metadata of DCP's schema, never another error."""
    model = make_model()
    data = (save(tmp_path, 1, model, rng={0: torch.get_rng_state()}) / ".metadata").read_bytes()
    draw = random.Random(0)
    outcomes = set()
    for _ in range(300):
        damaged = bytearray(data)
        for _ in range(draw.randint(1, 3)):
            damaged[draw.randrange(len(data))] = draw.randrange(256)
        try:
            outcomes.add(type(parse(bytes(damaged), "x")).__name__)
        except DcpFailure as error:
            outcomes.add(type(error).__name__)
    assert outcomes <= {"Metadata", "DcpFailure", "Refused"} and "Refused" in outcomes
