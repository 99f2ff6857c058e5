"""The fused-QKV split of an async checkpoint, taken off the training thread (CPU ``FlatStager``
path).

torchtitan's ``FusedQKVLinear`` saves its fused ``wqkv`` as stock ``wq``/``wk``/``wv`` through a
state-dict post hook (``_split_qkv_on_save``): per layer it all-gathers the FSDP-sharded ``wqkv`` to
Replicate (a collective on the training process group, plus DTensor dispatch) and splits it. On
titan-tiny that was ~11 ms of the ~24 ms an async save blocked training (bench/README.md).

``QkvSplit`` does the same in two halves. On the training thread, ``states`` builds the save's state
dict with that hook muted: the sharded ``wqkv`` as it is, no collective. ``FlatStager`` copies the
local shards (training waits for that copy only, as before); then ``finish`` runs on the stager's
thread: ONE all-gather of every staged ``wqkv`` shard on the checkpoint's own gloo group (the group
DCP's background save plans on, idle until ``finish`` returns: one save in flight at a time), the
hook's own reshape / slice / contiguous on the full tensors (pure data movement: bit-exact), each
result wrapped as a Replicate DTensor with the spec the hook gave that key (``ModelWrapper``'s
cache), in ``ModelWrapper.state_dict``'s key order. Same keys, placements, dtypes, values and order
as the hook: DCP writes the same files, and the load path (``_merge_qkv_on_load``) is untouched.

``QkvSplit.build`` returns None (the adapter then saves as before) unless that is exactly
reproducible: a ``ModelWrapper``; every fused ``wqkv`` a DTensor ``Shard(0)`` on a 1-D mesh over all
ranks in rank order (FSDP), evenly divided, one dtype; the cached outputs Replicate DTensors on the
same mesh with the hook's shapes; and the state dict's keys, muted, are the cached keys with the
outputs replaced by ``wqkv``. TP, HSDP, uneven shards, another hook that changes keys: the old path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Entry:
    fused: str  # the fused key in the muted state dict (``<prefix>wqkv.weight`` / ``.bias``)
    outs: tuple[str, str, str]  # ``<prefix>wq.<p>``, ``wk``, ``wv``: the keys the hook writes
    specs: tuple[Any, Any, Any]  # their DTensorSpecs (Replicate), from ModelWrapper's cache
    shape: tuple[int, ...]  # the global shape of the fused tensor
    local_numel: int
    n_kv: int
    hpk: int
    hd: int
    r: int
    tail: tuple[int, ...]


def _fused_cls() -> Any:
    from torchtitan.models.common.attention import FusedQKVLinear

    return FusedQKVLinear


class QkvSplit:
    """The plan for one model (see the module docstring); built once, used for every async save."""

    def __init__(
        self,
        wrapper: Any,
        pg: Any,
        world: int,
        hooks: list,
        entries: list[_Entry],
        order: list[str],
        prefixes: list[str],
    ) -> None:
        self.wrapper, self.pg, self.world = wrapper, pg, world
        self._hooks = hooks  # (module, hook-dict key) of every FusedQKVLinear split hook
        self.entries = entries
        self.order = order  # model keys in ModelWrapper.state_dict order (the outputs, not wqkv)
        self._prefixes = prefixes
        self._fused = {e.fused for e in entries}
        self._outs = {k for e in entries for k in e.outs}

    # ------------------------------------------------------------ training thread
    @staticmethod
    def _split_hooks(parts: list) -> list:
        fused, hook = _fused_cls(), _fused_cls()._split_qkv_on_save
        return [
            (m, k)
            for part in parts
            for m in part.modules()
            if isinstance(m, fused)
            for k, h in m._state_dict_hooks.items()
            if h is hook
        ]

    @staticmethod
    def _muted_state_dict(parts: list, hooks: list) -> tuple[dict, list]:
        """The model state dict with the split hooks replaced by a recorder of (module, prefix)."""
        seen: list = []

        def record(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            seen.append((module, prefix))

        saved = [(m, k, m._state_dict_hooks[k]) for m, k in hooks]
        try:
            for m, k, _ in saved:
                m._state_dict_hooks[k] = record
            sd = {k: v for part in parts for k, v in part.state_dict().items()}
        finally:
            for m, k, h in saved:
                m._state_dict_hooks[k] = h
        return sd, seen

    @classmethod
    def build(cls, wrapper: Any, pg: Any) -> tuple["QkvSplit | None", str]:
        """The plan, or (None, why not). Structural only (the same on every rank); the caller agrees
        on it."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torchtitan.components.checkpointer.base import ModelWrapper

        if type(wrapper) is not ModelWrapper:
            return None, f"model state is a {type(wrapper).__name__}, not torchtitan's ModelWrapper"
        if pg is None or not (dist.is_available() and dist.is_initialized()):
            return None, "no checkpoint process group"
        world = dist.get_world_size()
        if world < 2 or dist.get_process_group_ranks(pg) != list(range(world)):
            return None, "the checkpoint group is not every rank in order"
        parts = list(wrapper.model)
        hooks = cls._split_hooks(parts)
        if not hooks:
            return None, "no fused qkv"
        raw, seen = cls._muted_state_dict(parts, hooks)
        prefixes = [p for _, p in seen]
        if len(set(prefixes)) != len(prefixes) or len(seen) != len(hooks):
            return None, "the split hooks did not each run once under distinct prefixes"
        cached = wrapper.cached_state_dict
        entries: list[_Entry] = []
        dtypes = set()
        for m, prefix in seen:
            hd, hpk, r = int(m.head_dim), int(m.heads_per_kv), int(m.r_dim)
            for param, ndim in (("weight", 2), ("bias", 1)):
                key = f"{prefix}wqkv.{param}"
                if key not in raw:
                    continue
                v = raw[key]
                if (
                    type(v) is not DTensor
                    or type(v._local_tensor) is not torch.Tensor
                    or v.ndim != ndim
                ):
                    return None, f"{key} is not a plain DTensor of {ndim} dims"
                mesh = v.device_mesh
                if mesh.ndim != 1 or mesh.mesh.tolist() != list(range(world)):
                    return None, f"{key}: mesh is not 1-D over every rank in order"
                if (
                    len(v.placements) != 1
                    or type(v.placements[0]) is not Shard
                    or v.placements[0].dim != 0
                ):
                    return None, f"{key}: placement {v.placements} is not Shard(0)"
                shape = tuple(v.shape)
                if shape[0] % world or tuple(v._local_tensor.shape) != (
                    shape[0] // world,
                    *shape[1:],
                ):
                    return None, f"{key}: {shape} is not evenly sharded over {world} ranks"
                if shape[0] % (r * hd):
                    return None, f"{key}: {shape[0]} rows are not n_kv * {r} * {hd}"
                n_kv = shape[0] // (r * hd)
                tail = tuple(shape[1:])
                outs = (f"{prefix}wq.{param}", f"{prefix}wk.{param}", f"{prefix}wv.{param}")
                want = ((n_kv * hpk * hd, *tail), (n_kv * hd, *tail), (n_kv * hd, *tail))
                specs = []
                for out, shp in zip(outs, want):
                    c = cached.get(out)
                    if type(c) is not DTensor or c.device_mesh != mesh or c.dtype != v.dtype:
                        return (
                            None,
                            f"{out}: cached value is not a DTensor of {v.dtype} on {key}'s mesh",
                        )
                    if (
                        not all(isinstance(p, Replicate) for p in c.placements)
                        or len(c.placements) != 1
                    ):
                        return None, f"{out}: cached placement {c.placements} is not Replicate"
                    meta = c._spec.tensor_meta
                    contiguous = torch.empty(shp, device="meta").stride()
                    if tuple(c.shape) != shp or meta is None or tuple(meta.stride) != contiguous:
                        return (
                            None,
                            f"{out}: cached shape {tuple(c.shape)} is not the split's {shp} "
                            "(contiguous)",
                        )
                    specs.append(c._spec)
                dtypes.add(v.dtype)
                entries.append(
                    _Entry(
                        key,
                        outs,
                        tuple(specs),
                        shape,
                        v._local_tensor.numel(),
                        n_kv,
                        hpk,
                        hd,
                        r,
                        tail,
                    )
                )
        if not entries:
            return None, "no fused qkv tensor in the state dict"
        if len(dtypes) != 1:
            return None, f"fused qkv tensors of several dtypes {sorted(map(str, dtypes))}"
        fused = {e.fused for e in entries}
        outs = [k for e in entries for k in e.outs]
        if set(cached) != (set(raw) - fused) | set(outs) or len(cached) != len(raw) - len(
            fused
        ) + len(outs):
            return None, "the muted state dict's keys are not the cached keys with wq/wk/wv as wqkv"
        return cls(wrapper, pg, world, hooks, entries, list(cached), prefixes), ""

    def states(self, states: dict, model_key: str) -> dict | None:
        """The save's state dict (``_flattened_model_states_sd``'s layout) with ``wqkv`` unsplit;
        None if the model no longer matches the plan (then save the old way)."""
        raw, seen = self._muted_state_dict(list(self.wrapper.model), self._hooks)
        if [p for _, p in seen] != self._prefixes or len(raw) != len(self.order) - len(
            self._outs
        ) + len(self._fused):
            return None
        sd = {k: v for k, v in states.items() if k != model_key}
        sd.update(raw)
        return sd

    # ------------------------------------------------------------ stager thread
    @torch.no_grad()
    def finish(self, staged: dict) -> dict:
        """The staged dict as the hook would have made it: gather + split of the staged ``wqkv``
        shards."""
        from torch.distributed.tensor import DTensor

        locals_ = [staged[e.fused] for e in self.entries]
        locals_ = [t._local_tensor if isinstance(t, DTensor) else t for t in locals_]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        out = flat.new_empty(self.world * flat.numel())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, flat, group=self.pg)
        out = out.view(self.world, -1)
        split: dict[str, Any] = {}
        off = 0
        for e in self.entries:
            # rank r's shard is rows [r*n/W, (r+1)*n/W): the C-order flatten of (W, local) is their
            # concatenation
            full = out[:, off : off + e.local_numel].reshape(e.shape)
            off += e.local_numel
            w = full.reshape(
                e.n_kv, e.r, e.hd, *e.tail
            )  # the hook's own ops, on the full local tensor
            parts = (
                w[:, : e.hpk].reshape(-1, *e.tail).contiguous(),
                w[:, e.hpk].reshape(-1, *e.tail).contiguous(),
                w[:, e.hpk + 1].reshape(-1, *e.tail).contiguous(),
            )
            for key, t, spec in zip(e.outs, parts, e.specs):
                if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                    t = (
                        t.clone()
                    )  # a view into the gathered buffer (n_kv == 1): own storage, as staged before
                split[key] = DTensor(t, spec, requires_grad=False)
        model = set(self.order) | self._fused
        final = {k: v for k, v in staged.items() if k not in model}
        for k in self.order:
            final[k] = split[k] if k in split else staged[k]
        return final
