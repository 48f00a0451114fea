"""Imported once by the forkserver of `tests.distributed`: pays torch's and optimus's lazy imports there.

Every child forked from the server inherits the loaded modules, so a test body
does not spend seconds in its first `torch.testing.assert_close` (which pulls in
sympy and torch.distributed.tensor) or its first kernel-backend lookup. A pytest
process has one forkserver, whichever code starts it first: `optimus train
parallel.nproc=N` run in-process forks its ranks from this one too, so the
trainer's rank module is imported here as optimus.local_launcher would have it.
"""

import torch
import torch.distributed  # noqa: F401

torch.testing.assert_close(torch.zeros(2), torch.zeros(2))

try:
    import pytest  # noqa: F401

    import optimus.model  # noqa: F401
    import optimus.parallel  # noqa: F401
    import optimus.train.rank  # noqa: F401
    from optimus.kernels import get_backend

    get_backend("torch")
except Exception:  # a broken module in the tree must fail in the test that uses it, not here
    pass
