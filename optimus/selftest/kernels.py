"""The expert-path kernels of the selected backend on this rank's device, at the recipe's shapes and the
awkward ones, against the plain-PyTorch reference (optimus.kernels.check, which states the tolerances).

A case whose tensors would take more than a quarter of the device's free memory is skipped and listed: the
recipe's own shape on a large model can be more than one device holds beside the reference's fp32 copies.
"""

from __future__ import annotations

import math

import torch

from optimus.config import OptimusConfig
from optimus.kernels import get_backend
from optimus.kernels.check import Case, KernelResult, check_backend, recipe_cases
from optimus.layout import experts_per_rank
from optimus.model import moe_layer_ids
from optimus.selftest.rates import free_bytes

DENSE = "none: a dense model (model.moe.n_experts=0, or no MoE layer) has no expert kernels"


def kernel_cases(cfg: OptimusConfig) -> list[Case]:
    """recipe_cases at the recipe's widths, this rank's experts (n_experts / parallel.ep) and a micro-batch's
    tokens; none for a dense model."""
    m = cfg.model
    if not moe_layer_ids(m):
        return []
    experts = experts_per_rank(m.moe.n_experts, cfg.parallel.ep)
    return recipe_cases(m.dim, m.moe.expert_dim, experts, m.moe.top_k, cfg.train.micro_batch * cfg.train.seq_len)


def case_bytes(case: Case, dtype: torch.dtype) -> int:
    """About the most a check of `case` holds at once: the inputs, weights, hidden activations and their
    gradients, each in `dtype` and again in the reference's fp32."""
    t, d, f, e, a = case.tokens, case.dim, case.ffn, case.experts, case.rows
    elements = t * d + 3 * e * d * f + a * (3 * d + 3 * f)  # x, W13 and W2, permuted rows, outputs, SwiGLU's h13/h
    return 2 * elements * (dtype.itemsize + 4)  # values and gradients; the backend's and the reference's


def check_kernels(backend_name: str, cases: list[Case], dtype: torch.dtype, device: torch.device) -> dict:
    """Each kernel of the backend on each case that fits a quarter of the free memory: the backend's resolved
    name, the results as rows (selftest.json's), and the skipped cases."""
    backend = get_backend(backend_name, device.type)  # auto: the checked device's (CPU tensors on a GPU node: torch)
    free = free_bytes(device)
    budget = free // 4 if free is not None else None
    fitting = [case for case in cases if budget is None or case_bytes(case, dtype) <= budget]
    skipped = [
        {"case": case.describe(), "bytes": case_bytes(case, dtype), "budget_bytes": budget}
        for case in cases
        if case not in fitting
    ]
    results = []
    for case in fitting:
        try:
            results += check_backend(backend, [case], [dtype], device)
        except torch.OutOfMemoryError:  # the estimate fell short: the case is skipped, as one over the budget is
            skipped.append({"case": case.describe(), "bytes": case_bytes(case, dtype), "budget_bytes": budget})
            skipped[-1]["ran_out_of_memory"] = True
            if device.type != "cpu":
                torch.get_device_module(device.type).empty_cache()
    return {"backend": backend.name, "results": [result_row(r, backend.name) for r in results], "skipped": skipped}


def result_row(result: KernelResult, backend: str) -> dict:
    """One result as selftest.json holds it: the error is null where it is infinite (a NaN, an Inf or a wrong
    shape), which JSON cannot write; `failure` is the sentence that says so, with the fallback."""
    return {
        "kernel": result.kernel,
        "dtype": result.dtype_name,
        "case": result.case.name,
        "shape": result.case.describe(),
        "error": None if math.isinf(result.error) else result.error,
        "tolerance": result.tolerance,
        "ok": result.ok,
        "failure": None if result.ok else result.failure(backend),
    }
