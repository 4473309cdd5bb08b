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
