"""The parameter all-gather that ends an optimizer step, overlapped with the next forward
(`optim.overlap_param_gather`).

The gradient sharder's gather() normally waits for its all-gathers before it returns. After
`overlap_param_gather(roots)` it returns with them in flight, and each part of the model
waits, in a forward pre-hook, only for the buckets that hold its own parameters:

- a *block* (each child of a ModuleList or ModuleDict child of a root: the
  transformer blocks) waits for the parameters of its whole subtree;
- a *root* (the module the caller runs: the model, or each pipeline stage) waits
  for the rest (embedding, final norm, LM head). step() starts these buckets
  first, then the blocks' in the order the forward runs the blocks (gather_order),
  so the later blocks' buckets travel while the first blocks compute.

What this needs from the model: a parameter is read only inside the forward of the
block that holds it, or of its root. Optimus's Transformer keeps to it (a router
reads its gate's weight inside its block; the fused cross-entropy reads the head's
weight inside the root's forward). Code that reads parameters outside a forward
after a step (a checkpoint save, the pipeline's tied-weight copy) calls
`wait_for_params()` first.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn


def forward_units(root: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, the parameters its forward pre-hook waits for) of one root: its blocks, then the root itself."""
    blocks = [
        block for child in root.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict))
        for block in child.children()
    ]  # fmt: skip
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    rest = [p for p in root.parameters() if id(p) not in in_blocks]
    return [(block, list(block.parameters())) for block in blocks] + [(root, rest)]


def buckets_of_params(sharder) -> dict[int, list[tuple[str, int]]]:
    """id(parameter) -> the (group, bucket index) pairs that hold a part of it, in a sharder's groups
    (optimus.optim.sharder.GradSharder; it imports this module, so it is not named here as a type)."""
    out: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for kind, group in sharder.groups.items():
        for bi, slot_ids in enumerate(group.bucket_slots):
            for i in slot_ids:
                out[id(group.flat.slots[i].param)].append((kind, bi))
    return out


def buckets_needed(params: list[nn.Parameter], where: dict[int, list[tuple[str, int]]]) -> dict[str, list[int]]:
    """{group: sorted bucket indices} holding a part of `params` (untrained parameters have no bucket)."""
    needs: dict[str, set[int]] = defaultdict(set)
    for p in params:
        for kind, bi in where.get(id(p), ()):
            needs[kind].add(bi)
    return {kind: sorted(buckets) for kind, buckets in needs.items()}


def attach_gather_waits(sharder, roots: list[nn.Module]) -> list:
    """Register the forward pre-hooks of every unit of `roots` and order each group's all-gathers as the forward
    needs them (gather_order). Returns the hooks' handles."""
    where = buckets_of_params(sharder)
    waits = [(module, buckets_needed(params, where)) for root in roots for module, params in forward_units(root)]
    for kind, group in sharder.groups.items():
        group.gather_order = gather_order(kind, len(group.flat.buckets), roots, waits)
    return [module.register_forward_pre_hook(_waiter(sharder, needs)) for module, needs in waits if needs]


def gather_order(kind: str, n_buckets: int, roots: list[nn.Module], waits: list[tuple[nn.Module, dict]]) -> list[int]:
    """The order a group's buckets are all-gathered in: the roots' own buckets (every root waits for them before its
    first block), then each block's in the order the forward runs the blocks, then any no unit waits for. The flat
    buffer holds the parameters in reverse model order (its buckets fill as the backward produces gradients), so
    buffer order would gather the first blocks' buckets last, and the first block would wait for nearly all of them.
    Every rank of a shard group holds the same blocks, so each issues the same order."""
    is_root = {id(root) for root in roots}
    at_start = [waits_of for module, waits_of in waits if id(module) in is_root]
    by_block = [waits_of for module, waits_of in waits if id(module) not in is_root]
    order: list[int] = []
    for needs in at_start + by_block:
        order += [bi for bi in needs.get(kind, ()) if bi not in order]
    return order + [bi for bi in range(n_buckets) if bi not in order]


def _waiter(sharder, needs: dict[str, list[int]]):
    def hook(module: nn.Module, args) -> None:
        sharder.wait_for_params(needs)

    return hook


__all__ = ["attach_gather_waits", "buckets_needed", "buckets_of_params", "forward_units"]
