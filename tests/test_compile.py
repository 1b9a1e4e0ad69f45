"""One-device cps.attention and CPAttention(None) inside torch.compile(fullgraph=True), the first
call compiled: the same values as eager (bitwise with the 'aot_eager' backend: the same kernel
runs), the LSE and its gradient, packed documents, windows and GQA; recompiles bounded when the
boundaries change every step; the export path (torch.export) still traces plain ops."""
import pytest
import torch

import cp_softcap as cps
from cp_softcap import compiled

B, S, H, HKV, D = 2, 24, 4, 2, 8


def _inputs(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    q = torch.randn(B, S, H, D, dtype=dtype) * 3
    k = torch.randn(B, S, HKV, D, dtype=dtype) * 3
    v = torch.randn(B, S, HKV, D, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _run(fn, seed, cu=None):
    q, k, v = _inputs(seed)
    out, lse = fn(q, k, v, cu)
    ((out ** 2).sum() + lse.clamp_min(-1e4).sum()).backward()
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _attend(q, k, v, cu):
    return cps.attention(q, k, v, softcap=3.0, window=(7, 0), return_lse=True, cu_seqlens=cu)


@pytest.mark.parametrize("packed", [False, True])
def test_attention_compiled_equals_eager(packed):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    for step in range(3):
        cu = torch.tensor([0, 4 + step, 13, S]) if packed else None
        got, want = _run(fn, step, cu), _run(_attend, step, cu)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (a - b).abs().max()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    compiled._sweep()
    assert not compiled._LIVE


def test_sinks_compiled_equal_eager():
    sinks = torch.tensor([6.0, -1.0, 9.0, 0.5], dtype=torch.float64, requires_grad=True)

    def attend(q, k, v, cu):
        return cps.attention(q, k, v, softcap=3.0, window=(7, 0), return_lse=True,
                             cu_seqlens=cu, sinks=sinks)

    fn = torch.compile(attend, fullgraph=True, backend="aot_eager")
    results = []
    for f in (fn, attend):
        sinks.grad = None
        results.append(_run(f, 5, torch.tensor([0, 9, S])) + [sinks.grad.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b), (a - b).abs().max()
    assert results[0][-1].abs().max() > 0


def test_layer_without_group_compiles():
    layer = cps.CPAttention(None, softcap=2.0)
    fn = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs(3)
    out = fn(q, k, v)
    out.sum().backward()
    q2, k2, v2 = _inputs(3)
    ref = layer(q2, k2, v2)
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(q.grad, q2.grad) and torch.equal(v.grad, v2.grad)


def test_unequal_lengths_need_their_alignment_when_compiled():
    """A causal call with Sq != Sk is refused inside torch.compile as in eager, and with
    causal_align='bottom_right' (cps.attention and CPAttention(None)) it equals eager."""
    q, k, v = _inputs(4)
    q = q[:, :9].detach().requires_grad_()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="causal_align='bottom_right'"):
        torch.compile(lambda q, k, v: cps.attention(q, k, v, softcap=3.0), fullgraph=True,
                      backend="aot_eager")(q, k, v)
    layer = cps.CPAttention(None, softcap=3.0, window=(7, 0), causal_align="bottom_right")
    for f in (lambda q, k, v: cps.attention(q, k, v, softcap=3.0, window=(7, 0),
                                            causal_align="bottom_right"), layer):
        results = []
        for g in (torch.compile(f, fullgraph=True, backend="aot_eager"), f):
            x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = g(*x)
            (out ** 2).sum().backward()
            results.append([out.detach()] + [t.grad for t in x])
        for a, b in zip(*results):
            assert torch.equal(a, b), (a - b).abs().max()


def test_no_grad_call_keeps_nothing():
    fn = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs(1)
    with torch.no_grad():
        out, _ = fn(q, k, v, None)
    compiled._sweep()
    assert not compiled._LIVE and torch.isfinite(out).all()


def test_second_backward_is_refused():
    fn = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs(2)
    out, _ = fn(q, k, v, None)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        out.sum().backward()


def test_inductor_matches_eager():
    import shutil
    if not any(map(shutil.which, ("g++", "c++", "clang++"))):
        pytest.skip("inductor on CPU needs a C++ compiler")
    torch._dynamo.reset()

    def block(q, k, v, cu):
        out, lse = _attend(torch.tanh(q) * 4, k, v, cu)
        return out * 2, lse

    fn = torch.compile(block, fullgraph=True)
    got, want = _run(fn, 0), _run(block, 0)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_export_still_traces_plain_ops():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return cps.attention(q, k, v, softcap=3.0)

    q, k, v = (t.detach() for t in _inputs(0, torch.float32))
    ep = torch.export.export(M(), (q, k, v))
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("cp_softcap" in n for n in names), names
    assert torch.allclose(ep.module()(q, k, v), M()(q, k, v), atol=1e-5)


def test_compile_is_not_taken_for_export(monkeypatch):
    """The compiled call runs the selected kernel through the library's operator, never the
    export math. A regression test for torch releases whose tracer answers
    torch.compiler.is_exporting() True inside any torch.compile trace (2.11, the GPU machines'
    torch: run this file there); torch 2.13 answers False, so here it checks the plain case."""
    from cp_softcap import api

    def refuse(*a, **k):
        raise AssertionError("the export math ran under torch.compile")
    monkeypatch.setattr(api, "export_attention", refuse)
    torch._dynamo.reset()
    fn = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    got, want = _run(fn, 4), _run(_attend, 4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_kernel_instance_as_backend():
    """A Kernel instance (not a name) reaches the operator through a key CPAttention registers."""
    from cp_softcap.kernels import get_kernel
    kernel = type(get_kernel("torch"))()           # a fresh instance, never seen before
    _assert_layer_compiles_bitwise(cps.CPAttention(None, softcap=2.0, backend=kernel), seed=6)


def _assert_layer_compiles_bitwise(layer, seed):
    """The layer compiled (aot_eager, fullgraph, first call compiled) and eager on the same
    inputs: output and every input gradient bitwise equal."""
    fn = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled_in, eager_in = _inputs(seed), _inputs(seed)
    out, ref = fn(*compiled_in), layer(*eager_in)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(out, ref)
    for a, b in zip(compiled_in, eager_in):
        assert torch.equal(a.grad, b.grad)


def test_a_kernel_whose_backward_differentiates_compiles():
    """flex's backward recomputes its forward and differentiates it with autograd; inside the
    backward operator (which runs below autograd) that needs autograd restored."""
    from cp_softcap.kernels import get_kernel

    class Recomputing(type(get_kernel("torch"))):
        def backward(self, dout, q, *args, **kwargs):
            y = q.detach().requires_grad_()
            with torch.enable_grad():
                (g,) = torch.autograd.grad((y.transpose(1, 2) * 2).sum(), y)
            assert torch.equal(g, torch.full_like(q, 2.0))
            return super().backward(dout, q, *args, **kwargs)
    _assert_layer_compiles_bitwise(cps.CPAttention(None, softcap=2.0, backend=Recomputing()), seed=7)


def test_unregistered_kernel_instance_is_refused():
    from cp_softcap.kernels import get_kernel
    kernel = type(get_kernel("torch"))()

    def call(q, k, v):
        return cps.attention(q, k, v, backend=kernel)

    fn = torch.compile(call, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="register_kernel"):
        fn(*_inputs(7))


def test_copying_saved_tensor_hook_is_refused_clearly():
    """A saved-tensor hook that copies what it saves frees the kept graph before its backward:
    the backward says so (never a wrong gradient)."""
    torch._dynamo.reset()
    fn = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs(8)

    def pack(t):
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = fn(q, k, v, None)
        out2, _ = fn(*_inputs(9), None)       # the next call frees the first call's graph
    with pytest.raises(RuntimeError, match="saved-tensor hook"):
        out.sum().backward()


@pytest.mark.parametrize("packed", [False, True])
def test_flex_first_compiled_call_equals_eager(packed):
    """flex builds its block masks with vmap (create_block_mask) and its CPU path is eager flex
    (vmap again). A compiled graph's first run calls the operator inside torch.compile's aliasing
    check, a dispatch mode that excludes functorch's keys: the operator gives the library call an
    ordinary dispatcher state, so that first call runs and equals eager. (flex has no CPU
    backward: forward only here; the GPU tests compile its backward.)"""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 64, h, 16) for h in (4, 2, 2))
    cu = [0, 20, 64] if packed else None

    def fn(q, k, v):
        return cps.attention(q, k, v, softcap=5.0, window=(9, 0), cu_seqlens=cu, backend="flex")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = fn(q, k, v)
        compiled_fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled_fn(q, k, v), eager)
        assert torch.equal(compiled_fn(q, k, v), eager)


def test_operator_restores_functorch_inside_a_dispatch_mode():
    """What the first compiled call does, without the compiler: an operator inside a dispatch
    mode. vmap fails there as it is, and works under the operator's dispatcher state."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    def vmapped():
        return torch.vmap(lambda x: x + torch.tensor(1.0))(torch.zeros(3))

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not seen:
                try:
                    vmapped()
                    seen.append("plain ok")
                except RuntimeError:
                    seen.append("plain fails")
                with compiled._eager_dispatch():
                    seen.append(torch.equal(vmapped(), torch.ones(3)))
            return func(*args, **(kwargs or {}))
    x = torch.zeros(2)
    with Probe():
        x.add(1)
    assert seen == ["plain fails", True], seen
