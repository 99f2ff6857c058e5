"""FSDP's side of the gradient recheck: what each rank contributes to the reduce-scatter, and the
re-run of a step on another rank (``recipes/sdc.py`` decides what the fingerprints mean).

Why the contribution: FSDP2 sums every rank's full gradient into shards with one reduce-scatter,
so a rank's compute error lands in whichever shards its wrong elements belong to. Fingerprinting
what each rank hands to that reduce-scatter (``ContributionTap``, installed with FSDP2's public
``set_custom_reduce_scatter``) names the rank that computed wrong, not the one the error reached.

Why another rank: a device that is wrong the same way every time agrees with itself on every
re-run. ``partner_run`` has each rank compute the batch of the rank before it in the ring (the
batches travel rank to rank), with the reduce-scatter skipped (the tap fingerprints its input and
hands back zeros), then restores the gradients as they were; the ranks exchange fingerprints, and a
batch whose two devices disagree implicates both (``sdc.partner_suspects`` intersects them). Only
where every rank is a data-parallel rank (FSDP/HSDP without TP, PP or CP): with TP a batch is
spread over devices that a ring of ranks does not follow.

The ``bitflip target=compute`` fault is injected here, in the contribution, where a compute error
would be.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ptops.recipes import sdc


class ContributionTap:
    """A reduce-scatter that fingerprints its input when armed, flips it under a ``compute``
    fault, and in a partner run skips the collective (zeros out). FSDP2 calls ``allocate`` and
    the object itself (its ``ReduceScatter`` interface, duck-typed: that class is not public)."""

    def __init__(self, probe: Any, step_of: Any):
        self.probe, self.step_of = probe, step_of
        self.armed = False
        self.partner = False
        self.sums: list[int] = []

    def arm(self, on: bool) -> None:
        self.armed, self.sums = bool(on), []

    def take(self) -> list[int]:
        out, self.sums = self.sums, []
        return out

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        faults = getattr(self.probe, "faults", None)
        if faults is not None:
            step, named = self.step_of(), [("contribution", input_tensor)]
            faults.flip_bits(step, lambda _t: named, faults.COMPUTE)
        if self.armed or self.partner:
            self.sums.append(sdc.tensor_sum(input_tensor))
        if self.partner:
            output_tensor.zero_()
            return None
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def install(model_parts: list[Any], probe: Any, step_of: Any) -> ContributionTap | None:
    """The tap on every FSDP module of the model; None where FSDP2 refuses a custom
    reduce-scatter (several parameter groups in one module) or nothing is sharded."""
    tap = ContributionTap(probe, step_of)
    modules = [m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return None
    try:
        for m in modules:
            m.set_custom_reduce_scatter(tap)
    except (ValueError, AttributeError):
        return None
    return tap


def data_parallel_only(parallel_dims: Any) -> bool:
    """Every rank a data-parallel rank: the ring of ranks is a ring of batches."""
    return all(int(getattr(parallel_dims, name, 1) or 1) == 1 for name in ("tp", "pp", "cp", "ep"))


def _ring(payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``payload`` (bytes) to the next rank; what the previous rank sent."""
    world, rank = dist.get_world_size(), dist.get_rank()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    got = torch.empty_like(size)
    for w in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, size, nxt), dist.P2POp(dist.irecv, got, prev)]
    ):
        w.wait()
    data = torch.empty(int(got.item()), dtype=torch.uint8, device=device)
    for w in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, payload.to(device), nxt), dist.P2POp(dist.irecv, data, prev)]
    ):
        w.wait()
    return data


def previous_batches(calls: list[tuple[tuple, dict]], device: torch.device) -> list[Any]:
    """The previous rank's forward-backward calls of this step (``torch.save`` on the way, loaded
    back with ``weights_only``: tensors and plain values only)."""
    buf = io.BytesIO()
    torch.save(calls, buf)
    data = _ring(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8), device)
    raw = io.BytesIO(data.cpu().numpy().tobytes())
    return torch.load(raw, map_location=device, weights_only=True)


def partner_run(trainer: Any, tap: ContributionTap, own: list[int]) -> tuple[list[int], list[int]]:
    """The step's batches of the previous rank computed here, the gradients left as they were;
    returns the batches whose two devices disagreed and the suspects (the same on every rank)."""
    params = [p for m in trainer.model_parts for p in m.parameters()]
    saved = [None if p.grad is None else sdc.local(p.grad).clone() for p in params]
    device = next((p.device for p in params), torch.device("cpu"))
    calls = previous_batches(trainer.ptops_fwd, device)
    tap.partner, tap.sums = True, []
    try:
        with torch.enable_grad():
            for args, kwargs in calls:
                trainer.ptops_forward_backward(*args, **kwargs)
    finally:
        tap.partner = False
    theirs = tap.take()
    for p, g in zip(params, saved):
        if g is None:
            p.grad = None
        else:
            sdc.local(p.grad).copy_(g)
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (own, theirs))
    mismatched = [i for i in range(world) if gathered[(i + 1) % world][1] != gathered[i][0]]
    return mismatched, sdc.partner_suspects(mismatched, world)


def exchange_flags(flag: bool) -> list[bool]:
    """Every rank's flag, by rank (a disagreement's rare path: who computed wrong)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, bool(flag))
    return [bool(f) for f in gathered]
