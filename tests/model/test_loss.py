"""The LM head fused with cross-entropy (optimus.model.loss) against the plain F.cross_entropy of full logits."""

import pytest
import torch
import torch.nn.functional as F

from optimus.model import Transformer
from optimus.model import loss as loss_module
from optimus.model.loss import linear_cross_entropy
from tests.model.test_model import tiny_config


def plain_per_token(h_TD, weight_VD, targets_T):
    return F.cross_entropy(F.linear(h_TD, weight_VD).float(), targets_T, reduction="none")


def assert_relative_error(actual, expected, tol=1e-6):
    """|actual - expected| / |expected| (Frobenius norms) at most `tol`: elementwise relative error is
    meaningless for gradient entries that are sums cancelling to almost nothing."""
    error = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    assert error <= tol, f"relative error {error:.2e} > {tol:.0e}"


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def inputs(T=37, D=16, V=50, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(V, D, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=gen)
    return h, weight, targets


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 rows (the minimum), so that 37 rows make two full chunks and a ragged one."""
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 1)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("reduce", ["mean", "weighted"])
def test_fp32_matches_plain_cross_entropy(reduce):
    h, weight, targets = inputs()
    # Eval's weighting: per-token weights, zeros for padding rows.
    weights_T = torch.rand(37, generator=torch.Generator().manual_seed(1)) * (torch.arange(37) % 5 != 0)

    def reduced(loss_T):
        return loss_T.mean() if reduce == "mean" else (loss_T * weights_T).sum()

    fused_T, plain_T = linear_cross_entropy(h, weight, targets), plain_per_token(h, weight, targets)
    torch.testing.assert_close(fused_T, plain_T, rtol=1e-6, atol=0)
    for fused, plain in zip(grads(reduced(fused_T), h, weight), grads(reduced(plain_T), h, weight)):
        assert_relative_error(fused, plain)


def test_chunk_rows_fit_the_cache_budget():
    assert loss_module.chunk_rows(8192) * 8192 * 4 == loss_module.CHUNK_BYTES
    assert loss_module.chunk_rows(10**7) == loss_module.MIN_CHUNK_ROWS


@pytest.mark.usefixtures("small_chunks")
def test_bf16_under_autocast_matches_plain_path():
    """The trainer's bf16 path: bf16 logits, fp32 loss; the gradient is rounded to bf16 before the GEMMs."""
    h, weight, targets = inputs(dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(h, weight, targets).mean()
        plain = F.cross_entropy(F.linear(h, weight).float(), targets)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)  # same bf16 logits, same fp32 reduction
    for a, b in zip(grads(fused, h, weight), grads(plain, h, weight)):
        assert a.dtype == torch.bfloat16
        assert_relative_error(a, b, tol=1e-2)  # bf16 rounds at 2^-8


def test_no_grad_saves_nothing():
    h, weight, targets = inputs()
    with torch.no_grad():
        loss_T = linear_cross_entropy(h, weight, targets)
    assert loss_T.grad_fn is None
    torch.testing.assert_close(loss_T, plain_per_token(h, weight, targets).detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_model_with_targets_matches_cross_entropy_of_its_logits(tie):
    model = Transformer(tiny_config(tie_embeddings=tie), kernels="torch")
    model.init_weights(0)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, 100, (2, 2, 12), generator=gen)
    fused = model(tokens, targets).mean()
    fused_grads = grads(fused, *model.parameters())
    plain = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.reshape(-1))
    plain_grads = grads(plain, *model.parameters())
    assert model(tokens, targets).shape == targets.shape
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    for a, b in zip(fused_grads, plain_grads):
        assert_relative_error(a, b)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("grad_enabled", [False, True])
def test_logit_gradient_is_made_only_under_grad_mode(grad_enabled):
    """An evaluation runs under no_grad with parameters that require grad: it must not make the [T, V]
    gradient of the logits (the training forward does, for its backward)."""
    h, weight, targets = inputs(T=256, V=512)
    with torch.profiler.profile(profile_memory=True) as prof, torch.set_grad_enabled(grad_enabled):
        linear_cross_entropy(h, weight, targets)
    largest = max(event.cpu_memory_usage for event in prof.events())
    logits_grad_bytes = 256 * 512 * 4
    assert (largest >= logits_grad_bytes) == grad_enabled, largest


def _vocab_parallel_rank(logits_TV: torch.Tensor, targets_T: torch.Tensor, grad_T: torch.Tensor):
    """One rank of a tp group: the loss of its columns of the logits, its columns' gradient, and the collectives
    its backward ran."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from optimus.model.loss import vocab_parallel_cross_entropy

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    v = logits_TV.shape[1] // dist.get_world_size()
    mine_Tv = logits_TV[:, dist.get_rank() * v : (dist.get_rank() + 1) * v].detach().clone().requires_grad_()
    loss_T = vocab_parallel_cross_entropy(mine_Tv, targets_T, mesh)
    with CommDebugMode() as comms:  # counts c10d's and the functional collectives alike
        (loss_T * grad_T).sum().backward()
    return loss_T.detach(), mine_Tv.grad, comms.get_total_counts()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_cross_entropy_matches_the_whole_vocabulary(dtype):
    from tests.distributed import run_distributed

    gen = torch.Generator().manual_seed(3)
    T, V, tp = 29, 24, 2
    logits_TV = (3 * torch.randn(T, V, generator=gen)).to(dtype)
    logits_TV[:, -5:] = float("-inf")  # padding rows of the head, masked as mask_padded_logits does
    targets_T = torch.randint(0, V - 5, (T,), generator=gen)
    grad_T = torch.rand(T, generator=gen)  # weights of a reduction, as the trainer's
    whole_TV = logits_TV.clone().requires_grad_()
    expected_T = F.cross_entropy(whole_TV.float(), targets_T, reduction="none")
    (expected_T * grad_T).sum().backward()
    ranks = run_distributed(_vocab_parallel_rank, tp, logits_TV, targets_T, grad_T)
    v = V // tp
    for rank, (loss_T, grad_Tv, backward_collectives) in enumerate(ranks):
        assert_relative_error(loss_T, expected_T.detach())
        expected_grad_Tv = whole_TV.grad[:, rank * v : (rank + 1) * v]
        assert grad_Tv.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # the gradient rounded to bf16, as the plain path's
        assert_relative_error(grad_Tv, expected_grad_Tv, tol)
        assert backward_collectives == 0, "the backward's gradient is local: no collective"
