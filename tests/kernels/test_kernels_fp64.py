"""The torch expert path in fp64 (no `_grouped_mm` there): finite-difference gradient checks of the whole path."""

from __future__ import annotations

import torch

from optimus.kernels import reference, torch_backend
from tests.kernels.test_kernels_torch import expert_path, make_problem


def test_fp64_expert_path_passes_gradcheck():
    leaves, token_idx_A, offsets_E = make_problem(T=6, D=4, F=3, E=3, K=2, dtype=torch.float64, empty_experts=(1,))

    def path(*tensors):
        return expert_path(torch_backend, tensors, token_idx_A, offsets_E)

    assert torch.autograd.gradcheck(path, leaves, eps=1e-6, atol=1e-7)
    torch.testing.assert_close(path(*leaves), expert_path(reference, leaves, token_idx_A, offsets_E))
