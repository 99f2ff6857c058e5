"""Reading DCP `.metadata` without arbitrary unpickling.

DCP writes `.metadata` with plain `pickle.dump`, and torch's
`FileSystemReader(path).read_metadata()` reads it back with plain `pickle.load`
(torch 2.13), which would execute any global a crafted file names. We read it
with a restricted unpickler that resolves only the dataclasses/enums of
`torch.distributed.checkpoint`, `torch.Size`, torch dtypes/layouts/memory
formats, `pathlib` paths and a few builtins, which is everything DCP itself
pickles. Anything else is refused (`UnsafeMetadata`). One builtin more, held on
a leash: `getattr`, which some Python releases (Debian 12's 3.11.2; 3.11.7
pickles by value) use to pickle an enum member by name; it resolves only a member of an
enum already allowed, nothing else (a crafted `getattr(dict, "fromkeys")` is
refused).
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path

_BUILTINS = {"set", "frozenset", "slice", "complex", "tuple", "list", "dict", "bytearray"}
_PATHLIB = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}


class UnsafeMetadata(pickle.UnpicklingError):
    pass


def _plain(module: str, name: str) -> bool:
    """The stdlib names both unpicklers allow as the real thing."""
    return (
        (module == "builtins" and name in _BUILTINS)
        or (module == "collections" and name in {"OrderedDict", "defaultdict"})
        or (module == "pathlib" and name in _PATHLIB)
    )


def _is_getattr(module: str, name: str) -> bool:
    return module in ("builtins", "__builtin__") and name == "getattr"


def _refused_getattr(cls) -> UnsafeMetadata:
    return UnsafeMetadata(f"refusing getattr({getattr(cls, '__name__', type(cls).__name__)}, ...)")


def _enum_member(cls, name):
    """``getattr`` as an enum's pickle by name uses it: a member of an allowed enum, or refused."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and type(name) is str
        and name in cls.__members__
    ):
        return cls[name]
    raise _refused_getattr(cls)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if _plain(module, name):
            return super().find_class(module, name)
        if _is_getattr(module, name):
            return _enum_member
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(
                obj, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return obj
        if module == "torch.serialization" and name == "_get_layout":
            return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint"):
            obj = super().find_class(module, name)
            import dataclasses

            if isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
        raise UnsafeMetadata(f"refusing to unpickle global {module}.{name}")


def load_metadata_bytes(data: bytes):
    return _SafeUnpickler(io.BytesIO(data)).load()


def read_metadata(ckpt_dir: Path | str):
    """Safely load `<ckpt_dir>/.metadata` into a DCP `Metadata` object."""
    data = (Path(ckpt_dir) / ".metadata").read_bytes()
    md = load_metadata_bytes(data)
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise UnsafeMetadata(f".metadata holds a {type(md).__name__}, expected Metadata")
    return md


def safe_reader(ckpt_dir: Path | str):
    """A `FileSystemReader` whose `read_metadata` uses the restricted unpickler.
    (Tensor chunks are already read by torch with `weights_only=True`.)"""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_metadata(self.path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _SafeFileSystemReader(str(ckpt_dir))


# ---- torch-free reading (for fast listing / structural verify) ---------------


class _Stub:
    """Inert stand-in for a DCP dataclass: pickle's BUILD fills its __dict__."""

    _qualname = "?"

    def __init__(self, *args):
        self._args = args

    def __setstate__(self, state):
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and all(x is None or isinstance(x, dict) for x in state)
        ):
            for part in state:
                if part:
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:  # custom __getstate__ (e.g. TensorProperties' tuple)
            self.__dict__["_state"] = state

    def __getattr__(self, name: str):
        # fields left at their class-level default are absent from the pickled state
        if name.startswith("_"):
            raise AttributeError(name)
        return None

    def __repr__(self) -> str:
        return f"<{self._qualname} {self.__dict__}>"


class _Name(str):
    """A torch global (dtype, layout) kept as its dotted name."""


_STUBS: dict[tuple[str, str], type] = {}


def _stub(module: str, name: str) -> type:
    key = (module, name)
    if key not in _STUBS:
        _STUBS[key] = type(
            name, (_Stub,), {"_qualname": f"{module}.{name}", "__module__": "ptops.ckpt._dcpmeta"}
        )
    return _STUBS[key]


def _stub_member(cls, name):
    """``getattr`` of an enum pickled by name, read without torch: an inert stub of its class."""
    if isinstance(cls, type) and issubclass(cls, _Stub) and type(name) is str:
        return cls(name)
    raise _refused_getattr(cls)


class _LiteUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if _plain(module, name):
            return super().find_class(module, name)
        if _is_getattr(module, name):
            return _stub_member
        if module == "torch" and name == "Size":
            return lambda seq=(): tuple(seq)
        if module == "torch" and name.isidentifier():
            return _Name(f"torch.{name}")
        if module == "torch.serialization" and name == "_get_layout":
            return lambda s: _Name(s)
        if module.startswith("torch.distributed.checkpoint") and name.isidentifier():
            return _stub(module, name)
        raise UnsafeMetadata(f"refusing to unpickle global {module}.{name}")


def read_metadata_lite(ckpt_dir: Path | str):
    """Load `.metadata` into inert stubs without importing torch. The result has the
    attributes of DCP's `Metadata` (`state_dict_metadata`, `storage_data`, ...); entry
    kinds are told apart by `type(x).__name__` ('TensorStorageMetadata',
    'BytesStorageMetadata'); sizes are tuples, dtypes their names."""
    data = (Path(ckpt_dir) / ".metadata").read_bytes()
    md = _LiteUnpickler(io.BytesIO(data)).load()
    if type(md).__name__ != "Metadata" or not isinstance(
        getattr(md, "state_dict_metadata", None), dict
    ):
        raise UnsafeMetadata(f".metadata holds a {type(md).__name__}, expected Metadata")
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise UnsafeMetadata(".metadata has no storage_data")
    return md
