"""examples/gemma2 --compile (inductor on CPU), first call compiled: "blocks" compiles each decoder
layer whole with fullgraph=True (attention one opaque operator inside; one graph per kind of
layer: the sliding-window and the global ones), "pieces" the 3 pieces around attention (3
graphs shared by all layers); the loss and gradients equal eager's (loss to float32 rounding,
gradients within 1e-5), parameter names unchanged."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2.config import get_config  # noqa: E402
from gemma2.model import Gemma2  # noqa: E402
from gemma2.parallelize import apply_ac, apply_compile  # noqa: E402

pytestmark = pytest.mark.timeout(300)


# blocks with the aot_eager backend (the block's graph as traced, run by eager kernels: bitwise
# equal to eager; inductor on whole blocks with CPAttention is tests_dist/test_compile_dist.py's),
# pieces with aot_eager, and with inductor as a slow case (inductor's CPU compile of the pieces
# took ~25 s of CI's 2 cores)
@pytest.mark.parametrize("mode,backend,graphs", [
    ("blocks", "aot_eager", 2), ("pieces", "aot_eager", 3),
    pytest.param("pieces", "inductor", 3, marks=pytest.mark.slow)])
def test_compiled_layers_equal_eager(tmp_path, monkeypatch, mode, backend, graphs):
    import shutil
    if not any(map(shutil.which, ("g++", "c++", "clang++"))):
        pytest.skip("inductor on CPU needs a C++ compiler")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))     # a cold compile, every time
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cfg = get_config("tiny", num_hidden_layers=2, sliding_window=16, attn_logit_softcapping=5.0)
    torch.manual_seed(0)
    eager = Gemma2(cfg)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * 0.15)
    compiled = Gemma2(cfg)
    compiled.load_state_dict(eager.state_dict())
    apply_ac(compiled, "selective")      # checkpointing around a compiled piece, as train.py allows
    apply_compile(compiled, mode, backend)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    ids = torch.randint(3, cfg.vocab_size, (2, 65))       # 64 tokens > window 16
    losses = []
    for model in (eager, compiled):
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    assert torch.isfinite(losses[1]) and torch.allclose(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.isfinite(a.grad).all(), name
        rel = ((a.grad - b.grad).norm() / b.grad.norm()).item()
        assert rel < 1e-5, (name, rel)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
