"""Content digest of a checkpoint's model and optimizer tensors.

One sha256 hex over the *logical* tensors, independent of file layout, sharding,
number of ranks and shard files:

    "ptops-digest-v1\\n", then for each included tensor in sorted key order:
    key \\0 dtype \\0 shape \\0 nbytes \\n  +  raw little-endian bytes (C order)

What is included:

* DCP (TorchTitan `step-N/`): every *tensor* entry of `.metadata` except those under
  `lr_scheduler.`, `dataloader.` and `train_state.`; i.e. the (flattened, top-level)
  model parameters/buffers and `optimizer.state.<fqn>.<name>` (exp_avg, exp_avg_sq,
  step, ...). Each tensor is assembled full-size from its chunks with DCP's own
  no-process-group load (resharding), in batches of at most `batch_bytes`, so a
  checkpoint written by 2 FSDP ranks digests the same as the same state written by 1.
* TRL/HF `checkpoint-N/`: every tensor of the model weights (`model.safetensors`,
  sharded `model-*.safetensors` via the index, or `pytorch_model.bin`; adapter weights
  for PEFT) under their own names, plus every tensor of `optimizer.pt` as
  `optimizer.state.<param index>.<name>` (`torch.load(weights_only=True, mmap=True)`).

Excluded everywhere: non-tensor values (optimizer hyper-parameters in `param_groups`,
LR scheduler, dataloader, RNG and trainer state). Two checkpoints with equal digests
hold bit-identical weights and optimizer moments.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

from ._util import ST_DTYPES, detect_kind, read_safetensors_header

DIGEST_VERSION = b"ptops-digest-v1\n"
DCP_EXCLUDE_PREFIXES = ("lr_scheduler.", "dataloader.", "train_state.")


class DigestError(RuntimeError):
    pass


def _dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


def _record(h, key: str, dtype: str, shape, nbytes: int) -> None:
    h.update(f"{key}\0{dtype}\0{tuple(int(s) for s in shape)}\0{nbytes}\n".encode())


def _hash_tensor(h, key: str, t) -> None:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    _record(h, key, _dtype_name(t.dtype), t.shape, raw.numel())
    if raw.numel():
        h.update(memoryview(raw.numpy()))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder as is; a run directory or checkpoints folder -> its newest
    good checkpoint. Raises FileNotFoundError / DigestError."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"path not found: {p}")
    if p.is_dir() and detect_kind(p) != "unknown":
        return p
    from .catalog import latest_good

    good = latest_good(p, deep=True)
    if good is None:
        raise DigestError(f"no good checkpoint under {p}")
    return Path(good.path)


def digest(path: str | os.PathLike, *, batch_bytes: int = 512 << 20) -> str:
    """Hex digest of model + optimizer tensors of a checkpoint (or of a run
    directory's latest good checkpoint). See the module doc for what is included."""
    p = resolve_checkpoint(path)
    kind = detect_kind(p)
    h = hashlib.sha256(DIGEST_VERSION)
    if kind == "dcp":
        _digest_dcp(p, h, batch_bytes)
    elif kind == "trl":
        _digest_trl(p, h)
    else:
        raise DigestError(f"not a recognised checkpoint: {p}")
    return h.hexdigest()


# --------------------------------------------------------------------- DCP ----


def dcp_tensor_keys(md) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return sorted(
        k
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith(DCP_EXCLUDE_PREFIXES)
    )


def iter_dcp_tensors(
    ckpt_dir: str | os.PathLike, keys: list[str] | None = None, batch_bytes: int = 512 << 20
) -> Iterator[tuple[str, "object"]]:
    """Yield (key, full plain CPU tensor) in sorted key order, loading batches of
    at most `batch_bytes` with DCP's no-process-group load (safe metadata reader,
    tensor records read with weights_only=True)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ._dcpmeta import read_metadata, safe_reader

    p = Path(ckpt_dir)
    if not (p / ".metadata").is_file():
        raise DigestError(f"{p}/.metadata missing: not a complete DCP checkpoint")
    md = read_metadata(p)
    keys = dcp_tensor_keys(md) if keys is None else sorted(keys)
    batch: list[str] = []
    size = 0

    def load(batch_keys):
        sd = {}
        for k in batch_keys:
            tmd = md.state_dict_metadata[k]
            sd[k] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
            dcp.load(
                sd,
                storage_reader=safe_reader(p),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
        for k in batch_keys:
            yield k, sd[k]

    for k in keys:
        tmd = md.state_dict_metadata[k]
        numel = 1
        for s in tmd.size:
            numel *= int(s)
        nb = numel * tmd.properties.dtype.itemsize
        if batch and size + nb > batch_bytes:
            yield from load(batch)
            batch, size = [], 0
        batch.append(k)
        size += nb
    if batch:
        yield from load(batch)


def _digest_dcp(p: Path, h, batch_bytes: int) -> None:
    n = 0
    for k, t in iter_dcp_tensors(p, batch_bytes=batch_bytes):
        _hash_tensor(h, k, t)
        n += 1
    if n == 0:
        raise DigestError(f"{p}: no model/optimizer tensors in .metadata")


# --------------------------------------------------------------------- TRL ----


def _weight_files(p: Path) -> list[Path]:
    for idx in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        f = p / idx
        if f.is_file():
            wm = json.loads(f.read_text())["weight_map"]
            return [p / n for n in sorted(set(wm.values()))]
    for n in (
        "model.safetensors",
        "pytorch_model.bin",
        "adapter_model.safetensors",
        "adapter_model.bin",
    ):
        if (p / n).is_file():
            return [p / n]
    raise DigestError(f"{p}: no model weights")


def _safetensors_items(f: Path) -> dict[str, tuple[str, list[int], int, int, Path]]:
    header, start = read_safetensors_header(f)
    out = {}
    for k, info in header.items():
        dt = ST_DTYPES.get(info["dtype"], info["dtype"].lower())
        b, e = info["data_offsets"]
        out[k] = (dt, info["shape"], start + b, e - b, f)
    return out


def _flatten(prefix: str, obj, out: dict) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}", v, out)


def _digest_trl(p: Path, h) -> None:
    import torch

    st: dict = {}
    bins: dict = {}
    for f in _weight_files(p):
        if f.suffix == ".safetensors":
            items = _safetensors_items(f)
            dup = st.keys() & items.keys()
            if dup:
                raise DigestError(f"{f}: tensor {sorted(dup)[0]} also in another shard")
            st.update(items)
        else:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            _flatten("", sd, bins)
    model: dict[str, object] = dict(st)
    model.update({k[1:]: v for k, v in bins.items()})
    for k in sorted(model):
        v = model[k]
        if isinstance(v, tuple):
            dt, shape, off, n, f = v
            _record(h, k, dt, shape, n)
            with open(f, "rb") as fh:
                fh.seek(off)
                left = n
                while left:
                    chunk = fh.read(min(left, 8 << 20))
                    if not chunk:
                        raise DigestError(f"{f}: truncated in tensor {k}")
                    h.update(chunk)
                    left -= len(chunk)
        else:
            _hash_tensor(h, k, v)
    opt = p / "optimizer.pt"
    if not opt.is_file():
        raise DigestError(f"{opt}: missing")
    osd = torch.load(opt, map_location="cpu", weights_only=True, mmap=True)
    flat: dict = {}
    _flatten("optimizer.state", osd.get("state", {}) if isinstance(osd, dict) else {}, flat)
    for k in sorted(flat):
        _hash_tensor(h, k, flat[k])
