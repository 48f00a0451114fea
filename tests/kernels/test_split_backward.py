"""Zero bubble splits each backward into an input pass (`autograd.grad` towards the stage's inputs) and a weight
pass (towards its weights). torch's own operators compute only the pass's half; Optimus's custom Functions (the
expert GEMMs, the LM head's loss, the RMSNorm) learn which half from `needed_input_grads`. Each pass is checked
against one plain backward of the same graph (the reference), and the GEMMs each pass runs are counted."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.kernels import torch_backend
from optimus.kernels.rms_norm import rms_norm
from optimus.kernels.torch_private import needed_input_grads
from optimus.model.loss import linear_cross_entropy


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def expert_gemm(x, w):
    return torch_backend.grouped_mm_op(x, w, torch.tensor([3, 8]))


def lm_head_loss(x, w):
    return linear_cross_entropy(x, w, torch.arange(x.shape[0]) % w.shape[0])


def norm(x, w):
    return rms_norm(x, w[0], 1e-6)


CASES = {  # name -> (function of (x, weight), x's shape, the weight's shape)
    "expert grouped GEMM": (expert_gemm, (8, 4), (2, 4, 6)),
    "LM head's loss": (lm_head_loss, (8, 4), (5, 4)),
    "RMSNorm": (norm, (8, 4), (1, 4)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_input_and_weight_passes_give_one_backwards_gradients(name):
    fn, x_shape, w_shape = CASES[name]
    torch.manual_seed(0)
    x_leaf = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(w_shape, dtype=torch.float64, requires_grad=True)
    x = x_leaf * 1.5  # a stage input's path: the pass towards x_leaf runs the Function's input half
    out = fn(x, w)
    loss = (out.square() * torch.rand_like(out)).sum()  # unequal weights: no output's gradient mirrors another's
    with CountMatmuls() as input_pass:
        (dx,) = torch.autograd.grad(loss, [x_leaf], retain_graph=True)
    with CountMatmuls() as weight_pass:
        (dw,) = torch.autograd.grad(loss, [w], retain_graph=True)
    with CountMatmuls() as whole:
        loss.backward()
    torch.testing.assert_close(dx, x_leaf.grad, rtol=0, atol=0)
    torch.testing.assert_close(dw, w.grad, rtol=0, atol=0)
    if whole.calls:  # the GEMMs of one backward, split between the passes, none run twice
        assert input_pass.calls + weight_pass.calls == whole.calls, (input_pass.calls, weight_pass.calls, whole.calls)
        assert input_pass.calls and weight_pass.calls


def test_needed_input_grads_follows_the_running_backward():
    """a * b with `a` on a stage input's path and `b` a weight (a leaf): the input pass plans only a's path, the
    weight pass only b's accumulator (which the engine captures), a whole backward both; b frozen: never b."""
    seen = []

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            seen.append(needed_input_grads(ctx))
            a, b = ctx.saved_tensors
            return g * b, g * a

    a_leaf, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = Product.apply(a_leaf * 2, b).sum()
    torch.autograd.grad(out, [a_leaf], retain_graph=True)
    torch.autograd.grad(out, [b], retain_graph=True)
    out.backward()
    Product.apply(a_leaf * 2, torch.randn(3)).sum().backward()
    assert seen == [(True, False), (False, True), (True, True), (True, False)]


def test_a_norm_whose_input_needs_no_gradient_still_gives_its_weights():
    """One plain backward where only the weight needs a gradient (a frozen input): computed, not taken for a
    weight pass's hand-over."""
    torch.manual_seed(0)
    x, w = torch.randn(8, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64, requires_grad=True)
    rms_norm(x, w, 1e-6).square().sum().backward()
    (expected,) = torch.autograd.grad(reference_norm(x, w).square().sum(), [w])
    torch.testing.assert_close(w.grad, expected)


def reference_norm(x, w):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w
