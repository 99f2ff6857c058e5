"""One Markdown runbook per alert and finding: ``runbooks/<Name>.md`` (``ptops runbook NAME`` prints
one).

Convention for the commands in a runbook (``tests/diagnose/test_runbooks_run.py`` enforces it):

- The reader sets ``RUN`` once (``export RUN=runs/NAME``); every other value a command needs (the
  attempt N, the rank R, a pid, the latest or the bad checkpoint) is derived in the block from
  ``ptops status $RUN --json``, ``ptops diagnose $RUN --json`` or ``$RUN/events.jsonl`` with ``jq``.
  No placeholders (``<run>``, ``attempt-N``, ``PID``) in a block that runs.
- A fenced ```` ```bash ```` block is run, as written, by the test against a real faulted run
  directory (crash, hang, straggler, nan, corrupt; RL runbooks against a recorded GRPO run) and must
  exit 0 under ``set -e -o pipefail``. It only reads the run (writes go to the current directory).
- A fenced ```` ```bash act ```` block is shown, never run by the test: its first line is
  ``# act: <why>``. Use it for commands that act (resume, requeue, drain or exclude a node, kill),
  need a live process (``py-spy dump --pid``), or need the alert's host (``nvidia-smi``, ``dmesg``)
  or another run.
- A shell fence tagged otherwise (```` ```sh ````, ```` ```console ````, ```` ```bash foo ````) or
  an untagged fence is an error: nothing is skipped silently. Non-shell fences (```` ```toml ````)
  are text.

What the folder holds: one Markdown runbook per alert and finding; a test fails when a name used
anywhere has no file. Command convention (`runbooks/__init__.py`): the reader sets `RUN`; a `bash`
block block runs as written (values derived with `jq`) and `tests/diagnose/test_runbooks_run.py`
runs it against a real faulted run; a `bash act` block block (first line `# act: why`) acts, or
needs a live pid or the alert's host, and is not run; any other shell fence fails the test. May
import (of ptops): —.
"""
