"""torch's PipelineStage, with receive buffers that live as long as the micro-batch that uses them.

torch's `PipelineStage` allocates, when a schedule first runs, one receive buffer per micro-batch of the step for
each tensor a stage receives (its input, on every stage but the first; its output's gradient, on every stage but
the last) and keeps them all for the whole run. A schedule needs only those of the micro-batches in flight: with
hundreds of micro-batches per step the rest were GiBs that no step used (frontier-1t: 512 buffers of
[1, 256, 25,600] bf16 per kind, 12.5 GiB on a middle stage).

`Stage` allocates a buffer when its receive is posted and lets go of it once the micro-batch no longer needs it:
an input buffer after the stage's forward (the forward's saved tensors and torch's forward cache keep it until
its backward), a gradient buffer after the stage's backward. Between micro-batches the buffer's slot holds a
placeholder on the meta device, of the buffer's shape and dtype, which takes no memory. Dropping a reference
never frees what another still holds, so a schedule that keeps a tensor longer (zero bubble's deferred weight
pass) still has it. Once a micro-batch's whole backward has run, the received input's storage is freed
(`Stage._backward_done`): the schedule keeps the last stage's losses to the end of the step, and each loss's
graph holds its input.

The slots are torch's private `_RecvInfo.buffer` (optimus.kernels.torch_private: "pipeline_recv_buffers"). On a
torch without them `Stage` is torch's PipelineStage unchanged, and `releases_receive_buffers()` says so to the
memory plan, which then counts torch's buffers.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.pipelining import PipelineStage

from optimus.kernels import torch_private

META = torch.device("meta")


def releases_receive_buffers() -> bool:
    """Whether Stage lets go of its receive buffers between micro-batches on this torch."""
    return _RELEASES


_RELEASES = torch_private.found("pipeline_recv_buffers")  # probed once: it reads torch's source


def _received(infos) -> list:
    """The entries of a micro-batch's receive infos that torch receives into (not the first stage's own inputs,
    nor outputs with no gradient)."""
    return [info for info in infos if not info.is_root_arg and info.buffer is not None]


def _release(infos) -> None:
    for info in _received(infos):
        info.buffer = torch.empty_like(info.buffer, device=META)  # shape and dtype only


def _release_every_micro_batch(slots: dict) -> None:
    """`slots`: a stage's receive infos per micro-batch (args_recv_info or grad_recv_info)."""
    if releases_receive_buffers():
        for infos in slots.values():
            _release(infos)


def _allocate(infos, device: torch.device) -> None:
    for info in _received(infos):
        if info.buffer.device == META:
            info.buffer = torch.empty_like(info.buffer, device=device)


class Stage(PipelineStage):
    """A PipelineStage whose receive buffers exist only while their micro-batch needs them (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._inputs: dict[int, list[torch.Tensor]] = {}  # micro-batch -> its received inputs, until its backward

    # torch makes every micro-batch's buffers, as a schedule first runs, on `self.device`: here on the meta device,
    # as the placeholders they become. Made on the device, they were all alive together for a moment, a transient
    # of the whole set at the first step (6.25 GiB per kind on frontier-1t, measured by its dry run). torch 2.13
    # makes them in these two methods; where a torch makes them elsewhere, the releases below still apply, after
    # that transient.
    def _setup_forward_recv_info(self, *args, **kwargs):
        with self._buffers_made_on_meta():
            super()._setup_forward_recv_info(*args, **kwargs)

    def _setup_backward_recv_info(self, *args, **kwargs):
        with self._buffers_made_on_meta():
            super()._setup_backward_recv_info(*args, **kwargs)

    @contextlib.contextmanager
    def _buffers_made_on_meta(self):
        device = self.device
        if releases_receive_buffers():
            self.device = META  # (torch's setup reads self.device only to make the buffers)
        try:
            yield
        finally:
            self.device = device

    # Where this torch's setup makes them elsewhere, they are released as soon as it returns.
    def _prepare_forward_infra(self, *args, **kwargs):
        meta = super()._prepare_forward_infra(*args, **kwargs)
        _release_every_micro_batch(self.args_recv_info)
        return meta

    def _prepare_backward_infra(self, *args, **kwargs):
        meta = super()._prepare_backward_infra(*args, **kwargs)
        _release_every_micro_batch(self.grad_recv_info)
        return meta

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        if releases_receive_buffers():
            _allocate(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if releases_receive_buffers() and bwd_chunk_id in self.grad_recv_info:
            _allocate(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        # A same-rank neighbour hands its gradients over directly; one that is None zeroes the buffer in place.
        if releases_receive_buffers():
            _allocate(self.grad_recv_info[mb_index], self.device)
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            if releases_receive_buffers():
                infos = self.args_recv_info[fwd_chunk_id]
                if self.has_backward and torch.is_grad_enabled():
                    self._inputs[fwd_chunk_id] = [info.buffer for info in _received(infos)]
                _release(infos)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        try:
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        finally:
            if releases_receive_buffers() and bwd_chunk_id in self.grad_recv_info:
                _release(self.grad_recv_info[bwd_chunk_id])
        if full_backward:  # zero bubble's input pass (not full) leaves the weight pass to come
            self._backward_done(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self._backward_done(bwd_chunk_id)

    def _backward_done(self, chunk: int) -> None:
        """A micro-batch's backward has run on this stage: its received inputs' values are never read again, and
        their storage is freed even where something still holds the tensors until the end of the step: the last
        stage's loss, which the schedule keeps, and its graph, whose accumulator for the input holds it (torch
        detaches the stage's output for this reason, which does not cut a loss computed from it); a tracker's
        gradient hooks (torch's ModTracker, in profile.memory and dry runs), which hold the graph's nodes in a
        cycle through C++ that Python's garbage collector cannot see."""
        for received in self._inputs.pop(chunk, ()):
            received.data = received.new_empty(0)
