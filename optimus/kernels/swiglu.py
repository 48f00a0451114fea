"""The SwiGLU elementwise passes every schedule of the torch backend runs (in place, into given outputs)."""

import torch


def swiglu(h13_RF2: torch.Tensor, silu_RF: torch.Tensor, h_RF: torch.Tensor) -> None:
    """silu_RF = silu(gate), h_RF = silu(gate) * up, for h13 = [gate | up]."""
    n_ffn = silu_RF.shape[1]
    torch.ops.aten.silu.out(h13_RF2[:, :n_ffn], out=silu_RF)
    torch.mul(silu_RF, h13_RF2[:, n_ffn:], out=h_RF)


def swiglu_backward(dh_RF: torch.Tensor, h13_RF2: torch.Tensor, silu_RF: torch.Tensor, dh13_RF2: torch.Tensor):
    """dh13_RF2 = [d gate | d up] from dh = d(silu(gate) * up); overwrites dh_RF."""
    n_ffn = silu_RF.shape[1]
    gate_RF, up_RF = h13_RF2[:, :n_ffn], h13_RF2[:, n_ffn:]
    torch.mul(dh_RF, silu_RF, out=dh13_RF2[:, n_ffn:])
    torch.mul(dh_RF, up_RF, out=dh_RF)
    torch.ops.aten.silu_backward.grad_input(dh_RF, gate_RF, grad_input=dh13_RF2[:, :n_ffn])
