"""`optimus selftest`: a new node proves its kernels and collectives, and measures its rates, before a job spends it.

On every device of the node (one process each), the selftest

- runs every expert-path kernel of the selected backend (`--kernels`, default the recipe's `kernels`), forward
  and backward, against the plain-PyTorch reference at the recipe's shapes and at awkward ones, in the recipe's
  compute dtype (optimus.selftest.kernels; the tolerances are optimus.kernels.check's);
- measures the rates the performance model assumes: a GEMM at the step's shape as a fraction of the device's
  peak, the memory bandwidth, the kernel floor (optimus.selftest.rates);
- with more than one process, checks each collective kind of the start-up check on the node's world group for
  exact values and times it at a few sizes: bus bandwidth and latency, the intra-node link
  (optimus.selftest.collectives).

It prints one table, writes DIR/selftest.json and DIR/machine.yaml with `--out DIR` (optimus.selftest.report), and
says each failure in one sentence on stderr with exit code 1. `optimus plan --calibrate --out DIR` runs the rates
and the collectives and writes the same machine.yaml (optimus.commands.plan, through
optimus.commands.selftest, which runs both commands' processes).
"""
