"""The plan of a call (cp_softcap.plan): built once per call signature, and the cross-rank
signature is every compared field of the plan and its spec."""
import dataclasses

import torch

import cp_softcap as cps
from cp_softcap import plan as planning
from cp_softcap import plan_cache
from cp_softcap.kernels.torch_kernel import TorchKernel


def _spec(**kw):
    return cps.make_spec(head_dim=8, num_heads=4, num_kv_heads=2, dtype=torch.float32,
                         device_type="cpu", softcap=5.0, causal=True, **kw)


def test_signature_covers_every_compared_field_of_plan_and_spec():
    spec = _spec(window=(3, 0), cp_size=2)
    plan = planning.Plan(spec, 1, 8, "auto", TorchKernel(), 32768)
    rows = dict(planning.signature(plan))
    compared = [f for f in dataclasses.fields(plan) if not f.metadata.get("local")]
    assert len(rows) == len(compared) - 1 + len(dataclasses.fields(spec)) + 1   # spec flattened, window split
    assert rows["selected kernel"] == "torch" and rows["ring block keys"] == "32768"
    assert rows["local seq len"] == "8" and rows["softcap"] == "5.0" and rows["window left"] == "3"
    assert rows["dtype"] == "float32" and rows["comm"] == "ring"
    failed = planning.Plan(spec, 1, 8, "fa2", None, None)
    rows = dict(planning.signature(failed))
    assert rows["selected kernel"].startswith("none") and rows["ring block keys"].startswith("invalid")


def test_local_plan_is_built_once_per_signature():
    spec = _spec()
    first = planning.local_plan(spec, "torch")
    assert planning.local_plan(spec, "torch") is first
    assert planning.local_plan(_spec(window=(2, 0)), "torch") is not first
    assert first.kernel.name == "torch" and first.path == "kernel"


def test_kernel_instance_as_backend():
    """backend= takes a Kernel instance wherever it takes a name: it is used as given."""
    mine = TorchKernel(block_q=16, block_k=16)
    q, k, v = (torch.randn(1, 32, h, 8, dtype=torch.float64) * 3 for h in (4, 2, 2))
    calls = []
    forward = mine.forward
    mine.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
    out = cps.attention(q, k, v, softcap=5.0, backend=mine)
    assert calls and torch.allclose(out, cps.attention(q, k, v, softcap=5.0, backend="torch"))
    assert cps.select(_spec(), mine).kernel is mine


def test_boundaries_refilled_in_place_get_their_new_layout():
    """One boundaries tensor reused across steps and refilled without a version bump (through
    numpy or .data) must never keep the old layout: the cache is keyed on the values."""
    cu = torch.tensor([0, 40, 100, 128])
    first, err = plan_cache.documents(cu, 64, 2)
    assert err is None and first.cu_seqlens == (0, 40, 100, 128)
    version = cu._version
    cu.numpy()[:] = [0, 10, 20, 128]
    assert cu._version == version           # what a version-keyed cache would miss
    second, err = plan_cache.documents(cu, 64, 2)
    assert err is None and second.cu_seqlens == (0, 10, 20, 128)
    cu.data[:] = torch.tensor([0, 64, 65, 128])
    third, _ = plan_cache.documents(cu, 64, 2)
    assert third.cu_seqlens == (0, 64, 65, 128)
    assert plan_cache.documents(cu, 64, 2)[0] is third          # the same values: cached
    float_cu = torch.tensor([0.0, 64.0, 65.0, 128.0])          # equal values, wrong dtype
    assert isinstance(plan_cache.documents(float_cu, 64, 2)[1], TypeError)


def test_warm_plan_follows_what_the_plan_depends_on(monkeypatch):
    """A call whose raw arguments were seen gets its plan from the raw-call cache; every input
    the plan depends on is part of that key, so a change gives the changed plan, never the old
    one: gradient mode, requires_grad, the deterministic flag, a planning variable, dtype, and
    packed boundaries of the same length."""
    q, k, v = (torch.randn(1, 12, 2, 8) for _ in range(3))
    kw = dict(softcap=None, causal=True, window=None, scale=None, backend="auto")
    plan = lambda *t, **extra: planning.local_plan_for(*(t or (q, k, v)), **kw, **extra)  # noqa: E731
    base = plan()
    assert plan() is base and not base.spec.needs_backward
    grad = plan(q.clone().requires_grad_(), k, v)
    assert grad.spec.needs_backward
    with torch.no_grad():
        assert not plan(q.clone().requires_grad_(), k, v).spec.needs_backward
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(not deterministic)
        assert plan().spec.deterministic is not deterministic
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert plan() is base
    monkeypatch.setenv("CP_SOFTCAP_BACKEND", "torch")
    assert plan().backend == "auto" and plan() is not base
    monkeypatch.delenv("CP_SOFTCAP_BACKEND")
    wide = plan(*(t.to(torch.float64) for t in (q, k, v)))
    assert wide.spec.dtype == torch.float64 and wide.grad_dtype == torch.float64
    a, b = plan(cu_seqlens=[0, 5, 12]), plan(cu_seqlens=[0, 7, 12])
    assert (a.boundaries, b.boundaries) == ((0, 5, 12), (0, 7, 12))
    assert plan(cu_seqlens=torch.tensor([0, 5, 12])).boundaries == (0, 5, 12)


def test_plan_decides_the_accumulation_and_partial_dtypes():
    """The dtypes every CP algorithm reads from the plan instead of deciding per call."""
    for dtype, acc in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        spec = cps.make_spec(head_dim=8, num_heads=4, num_kv_heads=2, dtype=dtype, device_type="cpu")
        plan = planning.Plan(spec, 1, 8, "auto", TorchKernel(), 32768)
        assert plan.grad_dtype == acc and plan.partial_dtype == TorchKernel().partial_dtype(dtype)
        assert dataclasses.replace(plan, path="ring").grad_dtype == acc
    assert planning.Plan(spec, 1, 8, "fa2", None, None).partial_dtype is None


def test_raw_call_cache_stays_bounded_when_shapes_keep_changing():
    """A key length that grows every call (as in decoding) must not grow the cache forever."""
    q = torch.randn(1, 1, 2, 8)
    for n in range(1, plan_cache.MAX_CALL_PLANS + 40):
        kv = torch.randn(1, n, 2, 8)
        cps.attention(q, kv, kv, softcap=30.0, causal_align="bottom_right")   # decoding
    assert len(plan_cache.CALLS[plan_cache.ONE_DEVICE]) <= plan_cache.MAX_CALL_PLANS


def test_plan_cache_eviction_keeps_the_newest_within_both_bounds(monkeypatch):
    """plan_cache.evict (both plan caches): packed entries beyond MAX_PACKED_PLANS go oldest first,
    other entries stay; then anything beyond MAX_CALL_PLANS goes oldest first."""
    monkeypatch.setattr(plan_cache, "MAX_PACKED_PLANS", 2)
    monkeypatch.setattr(plan_cache, "MAX_CALL_PLANS", 5)
    cache = {}
    packed = lambda k, v: v == "packed"            # noqa: E731
    for key, kind in [(1, "plain"), (2, "packed"), (3, "packed"), (4, "plain"), (5, "packed")]:
        cache[key] = kind
        plan_cache.evict(cache, kind == "packed", packed)
    assert list(cache) == [1, 3, 4, 5]
    for key in (6, 7):
        cache[key] = "plain"
        plan_cache.evict(cache, False, packed)
    assert list(cache) == [3, 4, 5, 6, 7]
