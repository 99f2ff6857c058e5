"""The vLLM server's worker extension (``--worker-extension-cls``): the engine side of the CPU
weight sync of server mode (``engine.EngineSeam._server_sync``). Imported inside vLLM's worker
process: nothing of ptops beyond this file.

``ptops_reload(path, version)``: the worker reloads the safetensors the trainer wrote (vLLM's in-
place ``reload_weights``, which repacks the CPU build's linear layers), then repacks a tied
``lm_head``, which ``reload_weights`` leaves holding its pack of the old embedding, and remembers
the version (the trainer step). ``ptops_version()``: that version, -1 in an engine that has had no
sync since it started (a restarted engine serves its initial weights). ``ptops_exit()``: the
``engine-crash`` fault, the engine's process dies as a crashed engine's does. ``ptops_freeze()``:
the ``engine-hang`` fault, the engine's processes stop (SIGSTOP to its process group: alive and
silent, as a wedged engine is).
"""

from __future__ import annotations

import os
import signal
from typing import Any


class PtopsWorker:
    model_runner: Any  # the worker's (vLLM sets it)

    def ptops_reload(self, path: str, version: str = "-1") -> bool:
        self.model_runner.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if head is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
        self._ptops_version = int(version)
        return True

    def ptops_version(self) -> int:
        return getattr(self, "_ptops_version", -1)

    def ptops_exit(self) -> None:
        os._exit(70)

    def ptops_freeze(self) -> None:
        os.killpg(os.getpgrp(), signal.SIGSTOP)
