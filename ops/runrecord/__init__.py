"""The run record: the run directory, its event/state vocabulary, the JSONL writer and the one tail
reader.

- ``events``: ``EventKind``, ``RunState``, ``SPECS`` (fields per kind), ``reduce`` (events ->
  ``RunView``);
- ``jsonl``: ``append_jsonl`` (the writer), ``JsonlTail`` / ``read_jsonl`` (the reader);
- ``follow``: a run directory's two JSONL files tailed into sinks (the exporters);
- ``rundir``: the paths of a run directory; ``status``: ``status.json`` and ``ptops status``'s data.

Imports nothing else of ptops (design.md), so every layer above may read the record.
"""
