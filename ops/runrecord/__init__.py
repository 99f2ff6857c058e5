"""The run record: the run directory, its event/state vocabulary, the JSONL writer and the one tail
reader.

- ``events``: ``EventKind``, ``RunState``, ``SPECS`` (fields per kind), ``reduce`` (events ->
  ``RunView``) and ``Reducer`` (the same, one event at a time, for live exporters);
- ``jsonl``: ``append_jsonl`` (the writer), ``JsonlTail`` / ``read_jsonl`` (the reader);
- ``metrics``: ``metrics.jsonl`` rotated into ``metrics/NNNNNN.jsonl`` segments with an index
  (``MetricsWriter``), and the one reader of them (``iter_metrics``, ``rank0_records``,
  ``tail_records``, ``MetricsTail``);
- ``ranks``: rank lists as ranges for people (``rank_list``);
- ``follow``: a run directory's events and metrics tailed into sinks (the exporters);
- ``rundir``: the paths of a run directory; ``status``: ``status.json`` and ``ptops status``'s data.

Imports nothing else of ptops (design.md), so every layer above may read the record.

What the folder holds: the run directory: paths (`rundir.py`), the event/state vocabulary and the
reducer (`events.py`), the JSONL writer and tail reader (`jsonl.py`), the rotated metrics and their
index (`metrics.py`), which ranks a node line sums up (`nodesummary.py`: the writer's rule, and the
node agent's with `node_summaries`), ranks as ranges (`ranks.py`), followers for exporters
(`follow.py`), `status.json` (`status.py`), the run lock (`lock.py`), the goodput account
(`goodput.py`: productive time and where the rest went, for status, diagnose and the exporter
alike), the one format of what ptops writes into a rank's log (`ranklog.py`: every rank-side part
logs through it, no `print`; `tests/install/test_architecture.py` checks). May import (of ptops):
nothing.
"""
