"""numba bucket kernels: flatten/unflatten round trips, strided packing, bucket planning.

No arithmetic happens (elements are moved as integers of their width), so every comparison is
bit-exact, against the inputs and against the pure-torch fallback.
"""

from __future__ import annotations

import pytest
import torch

from meshplan import kernels
from meshplan.kernels import Bucket, KernelError, plan_buckets

pytest.importorskip("numba")


def _mixed(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 100).to(dtype)

    return [
        rand(3, 4),
        rand(5, 6).t(),                       # transposed
        rand(70_000),                         # spans two parallel chunks
        rand(2, 3, 4, 5)[:, 1:, ::2],         # sliced, stepped
        rand(2, 2, 2, 2, 2),                  # 5-D contiguous
        rand(),                               # 0-d
        rand(0, 3),                           # empty
        rand(8, 9)[:, 2:5].contiguous().expand(4, 8, 3),  # stride-0 dim
    ]


def _offsets(tensors, gap: int = 0) -> list[int]:
    out, at = [], gap
    for t in tensors:
        out.append(at)
        at += t.numel() + gap
    return out


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
          torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gap", [0, 3])
def test_flatten_round_trip_is_exact_and_equals_the_torch_fallback(dtype, gap) -> None:
    tensors = _mixed(dtype)
    offsets = _offsets(tensors, gap)
    size = offsets[-1] + tensors[-1].numel() + gap
    buf = torch.zeros(size, dtype=dtype)
    kernels.flatten_into(buf, tensors, offsets)
    ref = kernels.flatten_into_torch(torch.zeros(size, dtype=dtype), tensors, offsets)
    assert torch.equal(buf, ref)
    for t, off in zip(tensors, offsets):
        assert torch.equal(buf[off:off + t.numel()], t.reshape(-1))
    back = [torch.zeros_like(t) if t.stride().count(0) == 0 else torch.zeros(t.shape, dtype=dtype)
            for t in tensors]
    kernels.unflatten_from(buf, back, offsets)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unflatten_writes_through_non_contiguous_views(dtype) -> None:
    src = _mixed(dtype)[:4]
    offsets = _offsets(src)
    buf = kernels.flatten_into(torch.empty(sum(t.numel() for t in src), dtype=dtype), src, offsets)
    storages = [torch.zeros(3, 4, dtype=dtype), torch.zeros(5, 6, dtype=dtype),
                torch.zeros(70_000, dtype=dtype), torch.zeros(2, 3, 4, 5, dtype=dtype)]
    views = [storages[0], storages[1].t(), storages[2], storages[3][:, 1:, ::2]]
    twins = [s.clone() for s in storages]
    twin_views = [twins[0], twins[1].t(), twins[2], twins[3][:, 1:, ::2]]
    kernels.unflatten_from(buf, views, offsets)
    kernels.unflatten_from_torch(buf, twin_views, offsets)
    assert all(torch.equal(v, t) for v, t in zip(views, src))
    assert all(torch.equal(a, b) for a, b in zip(storages, twins))  # untouched elements too


def test_strided_shard_packing_matches_torch() -> None:
    w = torch.randn(12, 10)
    shards = [w.narrow(1, k * 5, 5) for k in range(2)] + [w[::3, 1:7:2]]
    packed = kernels.pack_strided(shards)
    assert torch.equal(packed, kernels.pack_strided_torch(shards))
    target = torch.zeros(12, 10)
    kernels.unpack_strided(packed[:120], [target.narrow(1, k * 5, 5) for k in range(2)])
    assert torch.equal(target, w)


def test_flatten_rejects_wrong_dtype_and_overflow() -> None:
    with pytest.raises(KernelError, match="one buffer per dtype"):
        kernels.flatten_into(torch.empty(4), [torch.ones(4, dtype=torch.float16)], [0])
    with pytest.raises(KernelError, match="does not fit"):
        kernels.flatten_into(torch.empty(4), [torch.ones(3)], [2])
    with pytest.raises(KernelError, match="offsets"):
        kernels.flatten_into_torch(torch.empty(4), [torch.ones(3)], [])


def test_buckets_keep_order_split_by_dtype_and_cap() -> None:
    sizes = [40, 40, 100, 8, 40, 4, 40]
    dtypes = ["float32", "float32", "float32", "float16", torch.float32, "float16", "float32"]
    buckets = plan_buckets(sizes, dtypes, bucket_bytes=80)
    assert buckets == [
        Bucket("float32", (0, 1), (0, 10), 20),
        Bucket("float32", (2,), (0,), 25),        # alone: larger than the cap
        Bucket("float16", (3, 5), (0, 4), 6),
        Bucket("float32", (4, 6), (0, 10), 20),
    ]
    assert all(b.nbytes <= 80 or len(b.indices) == 1 for b in buckets)
    assert sorted(i for b in buckets for i in b.indices) == list(range(len(sizes)))


def test_buckets_feed_flatten_and_unflatten() -> None:
    grads = [torch.randn(64, 32), torch.randn(96).half(), torch.randn(32, 32).t(), torch.randn(7)]
    buckets = plan_buckets([g.numel() * g.element_size() for g in grads],
                           [g.dtype for g in grads], bucket_bytes=8192)
    out = [torch.empty_like(g) for g in grads]
    for b in buckets:
        buf = kernels.flatten_into(b.buffer(), [grads[i] for i in b.indices], b.offsets)
        kernels.unflatten_from(buf, [out[i] for i in b.indices], b.offsets)
    assert len(buckets) == 3 and all(torch.equal(a, b) for a, b in zip(out, grads))


@pytest.mark.parametrize(("sizes", "dtypes", "cap", "message"), [
    ([4], ["float32", "float32"], 8, "2 dtypes"),
    ([6], ["float32"], 8, "whole number"),
    ([4], ["float32"], 0, "positive"),
    ([4], ["float8"], 8, "unknown dtype"),
])
def test_plan_buckets_rejects_bad_input(sizes, dtypes, cap, message) -> None:
    with pytest.raises(KernelError, match=message):
        plan_buckets(sizes, dtypes, cap)


def test_warm_cpu_loads_the_optimizer_kernel_a_spare_would_otherwise_load_in_its_first_step(
        ) -> None:
    """``kernels.warm_cpu`` (a fault-tolerance spare runs it while it waits, and swallows its
    errors there) calls the fused AdamW kernel as the lowering does: a change of that kernel's
    arguments must fail here, not silently cost every replaced rank 0.9 s."""
    from meshplan.kernels import _cpu_optim, warm_cpu

    warm_cpu()
    assert _cpu_optim._numba_kernel.cache_info().currsize == 1


def test_the_zygote_loads_the_same_kernel_signature_its_spares_would_call(monkeypatch) -> None:
    """The zygote loads the AdamW kernel once, before its first spare's fork, from numpy
    arrays (no tensor op there); the types it passes must be those ``warm_cpu`` and the
    lowering pass, or every spare would still compile its own."""
    from meshplan.kernels import _cpu_optim, warm_cpu
    from meshplan.runtime import _zygote

    monkeypatch.setattr(_zygote, "_WARMED", [])
    _zygote._warm_once({})
    assert _zygote._WARMED == [True]
    warm_cpu()
    assert len(_cpu_optim._numba_kernel().signatures) == 1
