"""What the folder holds: fault specs (`spec.py`), rank-side injectors (`inject.py`); the chaos
runner (`chaos.py`). May import (of ptops): `spec`/`inject`: ckpt; `chaos` also: ops.runrecord,
ops.supervisor (finding leftover processes), recipes (schema) — it drives launches as
subprocesses.
"""
