"""Scaling efficiency: one definition for measured runs (`optimus report`) and predicted ones (`optimus plan
--predict`), each relative to a base run on fewer devices.

    strong (same global batch):    (T_base x N_base) / (T x N)       T: step time, N: devices
    weak (same batch per device):  (tokens/s per device) / (tokens/s per device of the base)
"""

from __future__ import annotations


def strong_efficiency(base_step_s: float, base_devices: int, step_s: float, devices: int) -> float:
    return base_step_s * base_devices / (step_s * devices)


def weak_efficiency(base_tokens_per_s_per_device: float, tokens_per_s_per_device: float) -> float:
    return tokens_per_s_per_device / base_tokens_per_s_per_device
