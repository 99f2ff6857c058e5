"""ptops.ckpt: checkpoint manifest/commit protocol, verification, catalog, retention,
content digest and async DCP save for TorchTitan (DCP `step-N/`) and TRL/HF
(`checkpoint-N/`) checkpoints. Imports only the stdlib at import time; torch is
imported inside the functions that need it.
"""

from .async_save import AsyncCheckpointer, SaveRecord
from .catalog import Entry, checkpoints_dir, latest_good, list_checkpoints, quarantine
from .digest import DigestError, digest
from .manifest import (
    ManifestError,
    clear_writing,
    commit,
    mark_writing,
    read_latest,
    read_manifest,
    write_manifest,
)
from .retention import PruneReport, prune
from .verify import Result, verify

__all__ = [
    "AsyncCheckpointer", "SaveRecord",
    "Entry", "checkpoints_dir", "latest_good", "list_checkpoints", "quarantine",
    "DigestError", "digest",
    "ManifestError", "clear_writing", "commit", "mark_writing", "read_latest", "read_manifest", "write_manifest",
    "PruneReport", "prune", "Result", "verify",
]
