"""The host-sync counter: each kind of value read or value-dependent shape is counted, by optimus line."""

import torch

from optimus.host_syncs import HostSyncCounter
from optimus.optim.grad_norm import global_grad_norm


def test_each_kind_of_sync_is_counted_and_tensors_keep_their_tolist():
    x = torch.tensor([0, 2, 0, 1])
    original = torch.Tensor.tolist
    with HostSyncCounter() as counter:
        x.sum().item()  # 1
        x.tolist()  # 2
        bool(x.sum() > 0)  # 3
        x.nonzero()  # 4
        x[x > 0]  # 5: a boolean mask
        torch.repeat_interleave(x)  # 6: its length is the sum of the values
        torch.repeat_interleave(x, output_size=3)  # not a sync: the length is given
        x + 1  # not a sync
    assert torch.Tensor.tolist is original
    assert counter.counts == {"outside optimus": 6}


def test_a_sync_is_named_by_the_optimus_line_that_causes_it():
    with HostSyncCounter() as counter:
        global_grad_norm([torch.ones((), dtype=torch.float64)], None, distributed=False)
    ((where, count),) = counter.counts.items()
    assert where.startswith("optimus/optim/grad_norm.py:") and where.endswith(" global_grad_norm") and count == 1
    assert counter.as_list() == [{"where": where, "count": 1}]
