"""ptops.ckpt: the checkpoint lifecycle for TorchTitan (DCP `step-N/`) and TRL/HF
(`checkpoint-N/`) checkpoints: where to resume (`resume_point`), how a save becomes a
checkpoint (`SaveTransaction`), manifest/commit protocol, verification, catalog,
retention and content digest. Imports only the stdlib at import time; torch is imported
inside the functions that need it. Nothing outside this package imports its private
modules (`_util`, `_dcpmeta`): what others need is exported here.

What the folder holds: the checkpoint lifecycle (`lifecycle.py`: `resume_point`, `SaveTransaction`,
layout helpers), manifest/commit, verify, catalog, quarantine, retention, digest; `background.py`:
`BackgroundVerifier` (read-back verification of each commit, off the training thread). May import
(of ptops): nothing.
"""

from ._util import MANIFEST_NAME, detect_kind
from .background import BackgroundVerifier
from .catalog import Entry, checkpoints_dir, latest_good, list_checkpoints, quarantine
from .digest import DigestError, digest
from .lifecycle import (
    RESUME_ENV,
    SaveTransaction,
    checkpoint_path,
    is_writing,
    resume_point,
    shard_files,
)
from .manifest import (
    ManifestError,
    clear_writing,
    commit,
    mark_writing,
    read_latest,
    read_manifest,
    versions,
    write_manifest,
)
from .retention import PruneReport, prune
from .verify import Result, verify

__all__ = [
    "BackgroundVerifier",
    "RESUME_ENV",
    "SaveTransaction",
    "checkpoint_path",
    "is_writing",
    "resume_point",
    "shard_files",
    "Entry",
    "checkpoints_dir",
    "latest_good",
    "list_checkpoints",
    "quarantine",
    "DigestError",
    "digest",
    "MANIFEST_NAME",
    "detect_kind",
    "ManifestError",
    "clear_writing",
    "commit",
    "mark_writing",
    "read_latest",
    "read_manifest",
    "versions",
    "write_manifest",
    "PruneReport",
    "prune",
    "Result",
    "verify",
]
