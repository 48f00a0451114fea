"""adamw_update (fused kernel and single-tensor arithmetic) against torch.optim.AdamW on the same values.

The flat update runs over segments with and without weight decay, split into chunks (UPDATE_CHUNK made small
so that chunks straddle segment ends), with the gradient scale the sharded optimizer applies (1 / world x clip
factor), for fp32 and bf16 gradients. The reference is torch.optim.AdamW's single-tensor path, one parameter
per segment, fed the gradient already scaled in fp32.
"""

import pytest
import torch

from optimus.optim import adamw
from optimus.optim.adamw import AdamWHyper, adamw_update, fused_kernel_available
from optimus.parallel.flat_buffer import Segment

HYPER = AdamWHyper(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR, STEPS = 3e-3, 5
SEGMENTS = [Segment(0, 700, True), Segment(700, 1000, False), Segment(1000, 1333, True)]


def reference_run(param0, grads, grad_scale):
    """torch.optim.AdamW (single-tensor) with one parameter per segment; returns the flat parameters."""
    params = [torch.nn.Parameter(param0[s.lo : s.hi].clone()) for s in SEGMENTS]
    groups = [
        {"params": [p], "weight_decay": HYPER.weight_decay if s.weight_decay else 0.0} for p, s in zip(params, SEGMENTS)
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps, foreach=False)
    for grad in grads:
        scaled = grad.float() * grad_scale
        for p, s in zip(params, SEGMENTS):
            p.grad = scaled[s.lo : s.hi].clone()
        opt.step()
    return torch.cat([p.detach() for p in params])


def flat_run(param0, grads, grad_scale, fused):
    param, m, v = param0.clone(), torch.zeros_like(param0), torch.zeros_like(param0)
    for step, grad in enumerate(grads, start=1):
        adamw_update(SEGMENTS, param, grad.clone(), m, v, LR, step, HYPER, grad_scale, fused=fused)
    return param


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("fused", [False, True])
def test_adamw_update_matches_torch_adamw(monkeypatch, fused, grad_scale, grad_dtype):
    if fused and not fused_kernel_available(torch.device("cpu")):
        pytest.skip("this torch has no fused AdamW kernel for CPUs")
    monkeypatch.setattr(adamw, "UPDATE_CHUNK", 256)  # chunks straddle the segment ends
    gen = torch.Generator().manual_seed(0)
    n = SEGMENTS[-1].hi
    param0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(STEPS)]
    expected = reference_run(param0, grads, grad_scale)
    got = flat_run(param0, grads, grad_scale, fused)
    assert not torch.equal(expected, param0)
    if fused:  # its own kernel: the same formula, rounded in another order
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(got, expected)


def test_fused_kernel_is_the_default_where_available(monkeypatch):
    calls = []
    monkeypatch.setattr(adamw, "_fused_chunk", lambda *a, **k: calls.append(a))
    param = torch.zeros(8)
    adamw_update([Segment(0, 8, True)], param, torch.ones(8), torch.zeros(8), torch.zeros(8), LR, 1, HYPER, 1.0)
    assert bool(calls) == fused_kernel_available(param.device)


def test_fused_kernel_availability_agrees_with_torch_adamw():
    """torch.optim.AdamW(fused=True) accepts a CPU parameter exactly where adamw_update uses the kernel."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], fused=True).step()
        torch_has_it = True
    except RuntimeError:
        torch_has_it = False
    assert fused_kernel_available(torch.device("cpu")) == torch_has_it
