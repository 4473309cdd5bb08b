"""Checkpoints (``DistributedStep.save_checkpoint`` / ``load_checkpoint``, runtime/_checkpoint.py)
on local worker processes, against the single-process eager run of the same code.

The check: train on one mesh, save, and resume in a fresh step whose model started from other
weights (another seed), on another mesh and plan family; the resumed losses and final state
must equal one eager process that ran every step without a break. Tolerances are those of
``test_distribute.py`` (same reasons: summation order of data-parallel and row-parallel sums).
A lost or misplaced piece of state (a shard read from the wrong offset, optimizer moments
dropped) shows up at O(1e-3) or more in the losses or weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.examples import gpt, mlp

SAVE_AT, STEPS = 2, 4


def _state(ex) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v.detach() for k, v in ex.model.state_dict().items()}


def _resume_equals_one_process(tmp_path: Path, build, first: dict, second: dict,
                               **load) -> meshplan.DistributedStep:
    ref = build(seed=0)
    want = [ref.step(*ref.batch(i)).detach() for i in range(STEPS)]
    ex = build(seed=0)
    path = tmp_path / "step.safetensors"
    with meshplan.distribute(ex.step, topology="h100", **first) as step:
        for i in range(SAVE_AT):
            torch.testing.assert_close(step(*ref.batch(i)).detach(), want[i],
                                       rtol=1e-5, atol=1e-6)
        assert step.save_checkpoint(path) == str(path)
    other = build(seed=1)           # other weights: only the checkpoint can make them right
    step = meshplan.distribute(other.step, topology="h100", **second)
    with step:
        step.load_checkpoint(path, **load)
        for i in range(SAVE_AT, STEPS):
            torch.testing.assert_close(step(*ref.batch(i)).detach(), want[i],
                                       rtol=1e-5, atol=1e-6, msg=f"loss at step {i}")
        step.sync()
    for k, v in _state(ref).items():
        torch.testing.assert_close(_state(other)[k], v, rtol=1e-5, atol=1e-5, msg=k)
    return step


@pytest.mark.timeout(240)
def test_resume_on_another_mesh_and_plan_equals_one_process(tmp_path: Path) -> None:
    """Saved from a Megatron plan on tp=2, resumed under FSDP on dp=2: the file holds whole
    tensors, so any mesh reads it; each rank reads only its own slices (here halves of other
    dims than the saving ranks held)."""
    _resume_equals_one_process(
        tmp_path, lambda seed: gpt.build(optimizer="adamw", clip=1.0, seed=seed),
        dict(mesh={"tp": 2}, strategy="megatron_tp"),
        dict(mesh={"dp": 2}, strategy="fsdp"))


def _mlp(seed: int):
    return mlp.build(optimizer="adamw", seed=seed)


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    """The MLP saved after ``SAVE_AT`` steps on dp=2, and the eager losses of all ``STEPS``."""
    ref = _mlp(0)
    want = [ref.step(*ref.batch(i)).detach() for i in range(STEPS)]
    ex = _mlp(0)
    path = tmp_path_factory.mktemp("ckpt") / "mlp.safetensors"
    with meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", topology="h100") as step:
        for i in range(SAVE_AT):
            step(*ref.batch(i))
        step.save_checkpoint(path)
    return path, want


@pytest.mark.timeout(240)
def test_load_into_a_running_mesh_through_the_chain(mlp_checkpoint, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``push=True`` (what the mpi launcher does by default): the controller ships the file to
    the host's cache through ``push_files`` and the ranks read that copy. A second load of the
    same file sends nothing (the cached copy has the same content hash)."""
    path, want = mlp_checkpoint
    cache = tmp_path / "cache"
    monkeypatch.setenv("MESHPLAN_CACHE", str(cache))
    sent = []
    from meshplan.runtime import _files

    real = _files.push_files

    def counting(*args, **kw):
        result = real(*args, **kw)
        sent.append(result.bytes_sent)
        return result

    monkeypatch.setattr(_files, "push_files", counting)
    ref, other = _mlp(0), _mlp(1)
    with meshplan.distribute(other.step, mesh={"dp": 4}, strategy="fsdp",
                             topology="h100") as step:
        step(*ref.batch(0))                  # the mesh runs, from the wrong weights
        step.load_checkpoint(path, push=True)
        step.load_checkpoint(path, push=True)
        for i in range(SAVE_AT, STEPS):
            torch.testing.assert_close(step(*ref.batch(i)).detach(), want[i],
                                       rtol=1e-5, atol=1e-6, msg=f"loss at step {i}")
    copies = list(cache.rglob("mlp.safetensors"))
    assert len(copies) == 1 and copies[0].read_bytes() == path.read_bytes()
    assert sent == [path.stat().st_size, 0]


@pytest.mark.timeout(240)
def test_distribute_checkpoint_argument_starts_the_mesh_from_the_file(mlp_checkpoint,
                                                                      tmp_path: Path) -> None:
    """``distribute(checkpoint=PATH)`` before the step was ever traced: the file is checked at
    once and applied at the first call; the launch starts every rank from it."""
    path, want = mlp_checkpoint
    ref, other = _mlp(0), _mlp(1)
    with pytest.raises(meshplan.RuntimeFailure, match="does not exist"):
        meshplan.distribute(other.step, mesh={"dp": 2}, checkpoint=tmp_path / "no.safetensors")
    with meshplan.distribute(other.step, mesh={"dp": 2}, strategy="fsdp", topology="h100",
                             checkpoint=path) as step:
        for i in range(SAVE_AT, STEPS):
            torch.testing.assert_close(step(*ref.batch(i)).detach(), want[i],
                                       rtol=1e-5, atol=1e-6, msg=f"loss at step {i}")


def test_save_is_atomic_and_bad_files_are_one_clear_error(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """No mesh needed: the controller's step saves and loads its own state the same way."""
    from safetensors.torch import save_file

    ex = mlp.build(optimizer="adamw", seed=0)
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, example_inputs=ex.batch(0))
    path = tmp_path / "a.safetensors"
    step.save_checkpoint(path)
    before = path.read_bytes()
    meta = json.loads(__import__("safetensors").safe_open(str(path), "pt").metadata()["meshplan"])
    assert meta["format"] == "meshplan-checkpoint" and meta["saved_from"]["mesh"] == {"dp": 2}
    assert set(meta["roles"].values()) <= {"param", "buffer", "grad", "opt_state"}

    import meshplan.runtime._checkpoint as ck

    def broken(tensors, where, metadata=None):
        Path(where).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(meshplan.RuntimeFailure, match="No space left.*former file"):
        step.save_checkpoint(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors"]       # no temporary left

    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(meshplan.RuntimeFailure, match="not a safetensors file"):
        step.load_checkpoint(tmp_path / "junk.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(meshplan.RuntimeFailure, match="not a meshplan checkpoint"):
        step.load_checkpoint(tmp_path / "plain.safetensors")
    # another configuration of the model: same names, other shapes
    values = {k: v for k, v in step._named_state().items() if k.startswith("model.")}
    name = sorted(values)[0]
    values[name] = torch.zeros(*[d + 1 for d in values[name].shape])
    ck.save_checkpoint(tmp_path / "other.safetensors", values,
                       dict.fromkeys(values, "param"), {})
    weights = {k: v.clone() for k, v in ex.model.state_dict().items()}
    with pytest.raises(meshplan.RuntimeFailure, match=f"{name} in .* is .*another configuration"):
        step.load_checkpoint(tmp_path / "other.safetensors")
    for k, v in ex.model.state_dict().items():          # nothing was changed
        assert torch.equal(v, weights[k]), k
    values.pop(name)
    values["model.not_a_layer.weight"] = torch.zeros(1)
    ck.save_checkpoint(tmp_path / "foreign.safetensors", values,
                       dict.fromkeys(values, "param"), {})
    with pytest.raises(meshplan.RuntimeFailure, match="not_a_layer.*does not have"):
        step.load_checkpoint(tmp_path / "foreign.safetensors")


# --- digests (format version 2): unit level, tiny tensors, no mesh ------------------------


def _tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of a few tiny tensors saved in 64-byte chunks (so a slice touches only
    some chunks of a tensor)."""
    import meshplan.runtime._checkpoint as ck

    monkeypatch.setattr(ck, "CHUNK_BYTES", 64)
    values = {"model.a": torch.randn(3, 5), "model.b": torch.arange(64.0).reshape(16, 4),
              "model.h": torch.randn(4, 6).to(torch.bfloat16), "model.m": torch.rand(7) > 0.5,
              "model.e": torch.zeros(0, 3), "model.s": torch.tensor(2.5)}
    path = tmp_path / "tiny.safetensors"
    ck.save_checkpoint(path, values, dict.fromkeys(values, "param"), {"mesh": {"dp": 2}})
    return path, values


def _data_offset(path: Path, name: str) -> int:
    """Where tensor ``name``'s bytes start in the file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


def test_pieces_read_back_equal_the_saved_tensors(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole tensors and slices (of dim 0, of a later dim, empty, of a 0-d tensor) read back
    exactly, with every chunk they touch checked; the header lists one digest per chunk."""
    import meshplan.runtime._checkpoint as ck

    path, values = _tiny(tmp_path, monkeypatch)
    info = ck.read_info(path)
    assert info.meta["version"] == 2 and info.specs["model.h"] == ((4, 6), "bfloat16")
    digests = info.meta["digests"]
    assert digests["chunk_bytes"] == 64 and len(digests["tensors"]["model.b"]) == 4
    assert digests["tensors"]["model.e"] == [] and len(digests["header"]) == 64
    whole = ck.read_whole(str(path))
    for k, v in values.items():
        assert whole[k].dtype == v.dtype and torch.equal(whole[k], v), k
    slices = {"model.a": (slice(1, 2), slice(0, 5)), "model.b": (slice(0, 16), slice(2, 4)),
              "model.h": (slice(2, 4), slice(0, 3)), "model.m": (slice(3, 7),),
              "model.e": (slice(0, 0), slice(0, 3)), "model.s": ()}
    got = ck.read_pieces(str(path), list(slices), slices)
    for k, index in slices.items():
        assert got[k].is_contiguous() and torch.equal(got[k], values[k][index]), k


def test_a_flipped_byte_is_refused_naming_the_tensor(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte flipped in model.b's data (its 3rd 64-byte chunk, rows 8-11): a whole read, a
    rank's slice that touches it (rows, or a column split: every row) are refused naming the
    file and the tensor; a slice of other rows and the other tensors still read."""
    import meshplan.runtime._checkpoint as ck

    path, values = _tiny(tmp_path, monkeypatch)
    at = _data_offset(path, "model.b") + 2 * 64 + 5
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    ck.read_info(path)                                  # the header is intact
    damaged = rf"{path} is damaged: tensor model.b does not match its digest \(chunk 3 of 4\)" \
              ".*restore it from a good copy, or save the checkpoint again"
    with pytest.raises(meshplan.RuntimeFailure, match=damaged):
        ck.read_whole(str(path))
    for index in [(), (slice(8, 12), slice(0, 4)), (slice(0, 16), slice(0, 2))]:
        with pytest.raises(meshplan.RuntimeFailure, match=damaged):
            ck.read_pieces(str(path), ["model.a", "model.b"], {"model.a": (), "model.b": index})
    rows = (slice(0, 8), slice(0, 4))
    got = ck.read_pieces(str(path), ["model.a", "model.b"], {"model.a": (), "model.b": rows})
    assert torch.equal(got["model.b"], values["model.b"][rows])
    assert torch.equal(got["model.a"], values["model.a"])


def test_an_edited_header_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header digest covers the tensor table and the metadata: a dtype reinterpreted
    (F32 -> I32, same size), swapped offsets, or a changed metadata field are refused by
    read_info and by a rank's read_pieces alike; so is a file cut short."""
    import meshplan.runtime._checkpoint as ck

    path, _ = _tiny(tmp_path, monkeypatch)
    good = path.read_bytes()
    n = int.from_bytes(good[:8], "little")
    head = json.loads(good[8:8 + n])
    a, b = (json.dumps(head[k]["data_offsets"]).replace(" ", "").encode()
            for k in ("model.a", "model.b"))
    edits = {
        "dtype": lambda h: h.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1),
        "offsets": lambda h: h.replace(a, b"@A").replace(b, a).replace(b"@A", b),
        "metadata": lambda h: h.replace(b'\\"dp\\": 2', b'\\"dp\\": 4'),
    }
    for what, edit in edits.items():
        header = edit(good[8:8 + n])
        assert header != good[8:8 + n] and len(header) == n, what
        path.write_bytes(good[:8] + header + good[8 + n:])
        with pytest.raises(meshplan.RuntimeFailure, match=rf"header of {path} is damaged.*"
                           "digest does not match.*save the checkpoint again"):
            ck.read_info(path)
        with pytest.raises(meshplan.RuntimeFailure, match="header of .* is damaged"):
            ck.read_pieces(str(path), ["model.a"], {"model.a": (slice(0, 1), slice(0, 5))})
    path.write_bytes(good[:-3])
    with pytest.raises(meshplan.RuntimeFailure, match=r"is damaged: tensor model\.\w+ ends past"):
        ck.read_info(path)


def test_a_version_1_file_loads_with_one_warning(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A file written the version-1 way (no digests) loads, unverified: read_info warns once
    per file, naming it (``distribute(checkpoint=)`` reads the header twice); reads work."""
    from safetensors.torch import save_file

    import meshplan.runtime._checkpoint as ck

    values = {"model.w": torch.randn(4, 3), "opt.state.model.w.exp_avg": torch.zeros(4, 3)}
    meta = {"format": "meshplan-checkpoint", "version": 1,
            "roles": {"model.w": "param", "opt.state.model.w.exp_avg": "opt_state"},
            "saved_from": {"mesh": {"dp": 2}, "strategy": "dp"}, "torch": torch.__version__,
            "created": "2024-01-01T00:00:00+00:00"}
    path = tmp_path / "v1.safetensors"
    save_file(values, str(path), metadata={"meshplan": json.dumps(meta, sort_keys=True)})
    with caplog.at_level("WARNING", logger="meshplan.runtime._checkpoint"):
        assert ck.read_info(path).specs["model.w"] == ((4, 3), "float32")
        ck.read_info(path)
    warned = [r.getMessage() for r in caplog.records if "version-1" in r.getMessage()]
    assert len(warned) == 1 and str(path) in warned[0] and "unverified" in warned[0]
    whole = ck.read_whole(str(path))
    assert all(torch.equal(whole[k], v) for k, v in values.items())
    got = ck.read_pieces(str(path), ["model.w"], {"model.w": (slice(2, 4), slice(0, 3))})
    assert torch.equal(got["model.w"], values["model.w"][2:])
