"""``ptops pipeline``: supervised training stages with verified hand-offs (spec, runner, status,
lineage)."""
