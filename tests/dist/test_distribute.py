"""``meshplan.distribute`` end to end: the user's step on local worker processes (gloo over
loopback) against the single-process eager run of the same code from the same seed.

Tolerance: plans that reduce partial sums across ranks (data-parallel gradients, row-parallel
matmuls) add fp32 numbers in another order than one process, so losses and final state are
compared with rtol 1e-5 / atol 1e-6: a handful of AdamW steps on these small models stays far
inside fp32's ~7 significant digits, while any wrong shard or missing reduction is off by O(1).
Parameters get atol 1e-5: where the true gradient is ~0 (attention's key bias: softmax ignores
it) AdamW's update m / sqrt(v) divides rounding noise by rounding noise, so a different
summation order can move such a weight by a few 1e-6 over five steps (measured: 2e-6 on GPT's
c_attn bias under Megatron TP); a wrong plan moves weights by ~lr = 3e-3 per step.

The optimizer's state is compared value by value with the eager optimizer's after the same
steps (AdamW's exp_avg, exp_avg_sq and step; SGD's momentum_buffer, with and without dampening),
under the same names the plan gives them (``opt.state.model.<parameter>.<key>``; a tied weight,
GPT's ``lm_head.weight`` = ``transformer.wte.weight``, has one entry, under its first name,
holding both uses' gradients). Tolerances: ``step`` is a count and must be equal. exp_avg and
momentum_buffer are in gradient units: rtol 1e-5 / atol 1e-6, as for the losses (measured:
at most 1.3e-7 apart, 6e-9 beyond rtol 1e-5, where the true gradient is ~0 as above; a wrong
or missing reduction is off by the gradient itself, 1e-4..1e-1 here). exp_avg_sq is in squared
gradient units, so its atol is squared too: rtol 1e-5 / atol 1e-12 (measured: 3e-10 apart on
values up to 9e-4, 3e-25 beyond rtol 1e-5; a gradient off by a factor moves it by that factor
squared).
"""

from __future__ import annotations

import pytest
import torch

import meshplan
from meshplan.examples import cnn, gpt, mlp

STEPS = 5


def _models(name: str):
    build = {"mlp": lambda: mlp.build(optimizer="adamw"),
             "mlp-sgd-dampening": lambda: _dampened(mlp.build(optimizer="sgd")),
             "cnn": lambda: cnn.build(optimizer="sgd", clip=1.0),
             "gpt": lambda: gpt.build(optimizer="adamw", clip=1.0),
            "gpt4": lambda: gpt.build(optimizer="adamw", clip=1.0,
                                      config=gpt.GPTConfig(n_layer=4))}[name]
    return build(), build()


def _dampened(ex):
    """SGD with dampening: its first step is not the steady step from a zero buffer, so it
    runs on the controller and the mesh takes over from the second call."""
    for g in ex.opt.param_groups:
        g["momentum"], g["dampening"] = 0.9, 0.5
    return ex


def _state(ex) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach() for k, v in ex.model.state_dict().items()}
    return out


def _optim_state(ex) -> dict[str, torch.Tensor]:
    """The eager optimizer's tensors under the plan's names, ``opt.state.model.<name>.<key>``
    (the examples' optimizer and model are the step's ``opt`` and ``model``).
    ``named_parameters()`` lists a tied weight once, under its first name, as the trace does."""
    return {f"opt.state.model.{name}.{key}": v.detach()
            for name, p in ex.model.named_parameters()
            for key, v in ex.opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)}


# per state key: (rtol, atol); tolerances and their reasons: module docstring
_OPTIM_TOLERANCE = {"step": (0.0, 0.0), "exp_avg": (1e-5, 1e-6), "momentum_buffer": (1e-5, 1e-6),
                    "exp_avg_sq": (1e-5, 1e-12)}


def _check_optim_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                       what: str) -> None:
    """``got`` holds exactly ``want``'s optimizer state entries, each equal within its key's
    tolerance (``_OPTIM_TOLERANCE``; a key without one is an error, not a pass)."""
    assert sorted(got) == sorted(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for k, v in want.items():
        key = k.rsplit(".", 1)[1]
        if key not in _OPTIM_TOLERANCE:
            raise AssertionError(f"{what}: no tolerance for optimizer state {key!r} ({k})")
        rtol, atol = _OPTIM_TOLERANCE[key]
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=atol, msg=f"{what} {k}")


def _send_bad_piece(step, suffix: str) -> None:
    """Give every rank a 3x3 piece of the state tensor named ``...suffix``, past the
    controller's checks (``load_state_dict`` refuses a wrong shape), so the next step fails on
    the ranks: how the tests make a rank raise."""
    name = next(n.target for n in step.plan.graph.inputs if n.target.endswith(suffix))
    step._send_state("set_state", {name: torch.zeros(3, 3)}, lambda rank, names: {"names": names})


def test_load_state_dict_takes_torch_formats_and_refuses_a_wrong_shape_on_the_controller():
    """``load_state_dict`` takes what ``model.state_dict()`` / ``opt.state_dict()`` return
    (here the eager copy's, after two steps of its own), sets the param groups'
    hyperparameters as ``opt.load_state_dict`` does, and refuses a tensor of another shape or
    an unknown key before any rank sees it; the next step equals the eager copy's (rtol 1e-5 /
    atol 1e-6, as the equivalence tests)."""
    ex, ref = _models("mlp")
    with meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="fsdp", telemetry=False) as step:
        step(*ex.batch(0))
        ref.step(*ref.batch(0))
        ref.step(*ref.batch(1))
        ref.opt.param_groups[0]["lr"] *= 0.5
        model_sd, optim_sd = ref.model.state_dict(), ref.opt.state_dict()
        bad = {**model_sd, "fc1.weight": torch.zeros(3, 3)}
        with pytest.raises(meshplan.RuntimeFailure, match=r"fc1\.weight has shape \[3, 3\]"):
            step.load_state_dict({"model": bad})
        with pytest.raises(meshplan.RuntimeFailure, match="'nope'.*model.state_dict"):
            step.load_state_dict({"model": {"nope": torch.zeros(1)}})
        step.load_state_dict({"model": model_sd, "optim": optim_sd})
        assert ex.opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]
        torch.testing.assert_close(step(*ex.batch(2)), ref.step(*ref.batch(2)),
                                   rtol=1e-5, atol=1e-6)


def _tied(ex) -> list[tuple[str, str]]:
    """Pairs of parameter names that are one tensor (GPT: ``lm_head.weight`` and
    ``transformer.wte.weight``)."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in ex.model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((first[id(p)], name))
        first.setdefault(id(p), name)
    return pairs


# (model, mesh, plan family): every launcher runs these against one process
EQUIVALENCE_CASES = [
    ("mlp", {"dp": 2}, "dp"),
    ("gpt", {"dp": 2, "tp": 2}, "megatron_tp"),
    ("gpt", {"dp": 2}, "fsdp"),
    ("mlp-sgd-dampening", {"dp": 2}, "dp"),
    ("cnn", {"dp": 2}, "fsdp"),
    ("gpt", {"tp": 2}, "megatron_tp"),
    ("mlp", {"dp": 4}, "fsdp"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "axes", "strategy"), EQUIVALENCE_CASES)
def test_distributed_steps_equal_one_process(name: str, axes: dict[str, int],
                                             strategy: str) -> None:
    check_equal_to_one_process(name, axes, strategy)


# kernels off changes only the optimizer update (the plan's ops instead of one fused call):
# one case per optimizer kernel and per family that updates sharded state (suite time)
KERNELS_OFF_CASES = [EQUIVALENCE_CASES[1], EQUIVALENCE_CASES[3], EQUIVALENCE_CASES[4]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "axes", "strategy"), KERNELS_OFF_CASES)
def test_distributed_steps_equal_one_process_with_kernels_off(name: str, axes: dict[str, int],
                                                              strategy: str) -> None:
    """The cases above run with the lowering's kernels (each rank's AdamW / SGD update is one
    fused in-place call); the same check holds with them off (the plan's ops one by one):
    AdamW on a Megatron mesh, SGD with momentum and dampening, and an FSDP (sharded) update."""
    from meshplan.backends import lower
    from meshplan.backends._kernels import kernel_summary

    def programs_had_kernels(step) -> None:
        assert step.kernels is False
        assert kernel_summary(lower(step.plan, 0).instructions)      # on by default
        assert not kernel_summary(lower(step.plan, 0, kernels=False).instructions)

    check_equal_to_one_process(name, axes, strategy, after_steps=programs_had_kernels,
                               kernels=False)


def check_equal_to_one_process(name: str, axes: dict[str, int], strategy: str,
                               after_steps=None, **options) -> None:
    """``STEPS`` distributed steps against the eager run: the loss of every step, then the
    parameters and the optimizer's state value by value, as ``state_dict()`` gathers them and
    as ``sync()`` writes them back, tied weights still one tensor (tolerances: module
    docstring); ``options`` go to ``distribute``; ``after_steps(step)`` may check the mesh."""
    ex, ref = _models(name)
    step = meshplan.distribute(ex.step, mesh=axes, strategy=strategy, topology="h100",
                               **options)
    with step:
        for i in range(STEPS):
            got, want = step(*ex.batch(i)), ref.step(*ref.batch(i))
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"loss at step {i}")
        if after_steps is not None:
            after_steps(step)
        sd = step.state_dict()
        step.sync()
    # state_dict() answers in torch's formats: model.state_dict() keys (a tied weight under
    # both of its keys) and opt.state_dict() (state by parameter position, param groups)
    want = {k: v.detach() for k, v in ref.model.state_dict().items()}
    assert sorted(sd["model"]) == sorted(want), name
    for k, v in want.items():
        torch.testing.assert_close(sd["model"][k], v, rtol=1e-5, atol=1e-5, msg=k)
        torch.testing.assert_close(_state(ex)[f"model.{k}"], v, rtol=1e-5, atol=1e-5,
                                   msg=f"synced {k}")
    want_sd = ref.opt.state_dict()
    assert sd["optim"]["param_groups"] == want_sd["param_groups"], name
    _check_optim_state(_positional(sd["optim"]), _positional(want_sd), "state_dict()")
    want_optim = _optim_state(ref)
    assert any(k.endswith(("exp_avg", "momentum_buffer")) for k in want_optim), name
    _check_optim_state(_optim_state(ex), want_optim, "synced")
    tied = _tied(ref)
    assert tied or not name.startswith("gpt"), "GPT's tied lm_head went untested"
    params = dict(ex.model.named_parameters(remove_duplicate=False))
    for owner, alias in tied:          # still one tensor after sync(), with one state entry
        assert params[alias] is params[owner], alias
        assert sd["model"][alias] is sd["model"][owner] or torch.equal(
            sd["model"][alias], sd["model"][owner]), alias


def _positional(optim_sd) -> dict[str, torch.Tensor]:
    """``opt.state_dict()``'s state as ``{"<position>.<key>": tensor}`` for
    ``_check_optim_state``."""
    return {f"{i}.{k}": v for i, entry in optim_sd["state"].items() for k, v in entry.items()
            if isinstance(v, torch.Tensor)}


@pytest.mark.timeout(120)
def test_a_failing_rank_is_raised_on_the_controller_with_its_rank_and_line() -> None:
    ex, _ = _models("mlp")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", topology="h100",
                               fault_tolerance=False)   # its snapshot would refuse the piece
    with step:
        step(*ex.batch(0))
        step(*ex.batch(1))
        _send_bad_piece(step, "fc1.weight")
        with pytest.raises(meshplan.RuntimeFailure) as err:
            step(*ex.batch(2))
    text = str(err.value)
    assert "rank" in text and "mlp.py" in text, text


@pytest.mark.timeout(120)
def test_a_killed_rank_stops_the_run_and_names_it() -> None:
    """Without fault tolerance (on by default; tests/dist/test_faults.py has it on), a worker
    killed between steps: the next call raises RuntimeFailure naming its rank, and no worker
    survives (the others are stopped, nothing hangs)."""
    import os
    import signal
    import time

    ex, _ = _models("mlp")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", topology="h100",
                               timeout_s=60, fault_tolerance=False)
    with step:
        step(*ex.batch(0))
        step(*ex.batch(1))
        pids = list(step._workers.pids)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(meshplan.RuntimeFailure, match="rank 1"):
            step(*ex.batch(2))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:     # a zombie child of this process counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True



def _dropout_mlp():
    """The MLP with dropout (0.2) after its activation and after its output layer."""
    ex = mlp.build(optimizer="adamw")
    ex.model.act = torch.nn.Sequential(ex.model.act, torch.nn.Dropout(0.2))
    ex.model.fc2 = torch.nn.Sequential(ex.model.fc2, torch.nn.Dropout(0.2))
    return ex


def _dropout_run(ex, mesh: dict[str, int], strategy: str, steps: int, **options):
    """``steps`` steps of ``ex`` on ``mesh``: the losses, the step and every rank's raw state
    pieces (``get_state``) after the last step."""
    step = meshplan.distribute(ex.step, mesh=mesh, strategy=strategy, topology="cpu",
                               telemetry=False, **options)
    with step:
        losses = torch.stack([step(*ex.batch(i)).detach() for i in range(steps)])
        step._workers.broadcast("get_state", {})
        held = [dict(zip(r.header["names"], r.tensors))
                for r in step._workers.gather("get_state", 60)]
    return losses, step, held


def _random_warnings(caplog) -> list[str]:
    said = [r.getMessage() for r in caplog.records]
    return [m for m in said if "do not match one process" in m]


@pytest.mark.timeout(240)
def test_dropout_repeats_from_the_seed_and_says_it_differs_from_one_process(caplog) -> None:
    """The MLP with dropout under data parallelism (each rank's batch half draws its own masks):
    the run's seed is the controller's first draw after torch.manual_seed, and the warning
    that random ops do not match one process comes once, with it. Launched again on fresh
    workers from the same state (the controller's, never synced), the same seed gives
    bit-identical losses and another seed other losses."""
    import logging

    caplog.set_level(logging.WARNING, logger="meshplan.runtime._distributed")
    torch.manual_seed(3)
    drawn = int(torch.randint(0, 2**63 - 1, ()).item())
    torch.manual_seed(3)
    ex = _dropout_mlp()
    a, step, _ = _dropout_run(ex, {"dp": 2}, "dp", 2)
    said = _random_warnings(caplog)
    assert step.seed == drawn and len(said) == 1
    assert "do not match one process bit for bit" in said[0] and f"seed is {drawn}" in said[0]
    runs = []
    for seed in (drawn, drawn + 1):
        step._seed = seed
        with step:
            runs.append(torch.stack([step(*ex.batch(i)).detach() for i in range(2)]))
    assert torch.isfinite(a).all() and torch.equal(a, runs[0]) and not torch.equal(a, runs[1])
    assert len(_random_warnings(caplog)) == 1


def test_distribute_takes_an_int_seed() -> None:
    ex = mlp.build()
    assert meshplan.distribute(ex.step, mesh={"dp": 2}, seed=7).seed == 7
    assert meshplan.distribute(ex.step, mesh={"dp": 2}).seed is None     # drawn when needed
    with pytest.raises(meshplan.RuntimeFailure, match="seed must be an int"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, seed="7")


@pytest.mark.timeout(240)
def test_dropout_under_tensor_parallelism_keeps_replicas_equal() -> None:
    """Megatron TP on tp=2 (the MLP: fc1 split by columns, the rest replicated; both dropouts
    replicated on tp, so both ranks must draw the same masks): after two steps every state
    piece the two ranks both hold is bit-identical on them, and fc1's halves differ."""
    torch.manual_seed(4)
    losses, step, held = _dropout_run(_dropout_mlp(), {"tp": 2}, "megatron_tp", 2)
    assert torch.isfinite(losses).all()
    layouts = step.plan.input_layouts
    replicated = [k for k in held[0] if k in layouts and all(
        not isinstance(p, meshplan.planner.Shard) for p in layouts[k])]
    split = [k for k in held[0] if k in layouts and k not in replicated]
    assert any("norm.weight" in k for k in replicated) and split
    for k in replicated:
        assert torch.equal(held[0][k], held[1][k]), k
    assert any(not torch.equal(held[0][k], held[1][k]) for k in split)
