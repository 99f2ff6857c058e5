"""``ptops pipeline``: supervised training stages with verified hand-offs (spec, runner, status,
lineage).

What the folder holds: `ptops pipeline`: the pipeline file (`spec.py`: stages, inputs, gates,
validated with each stage's recipe), the runner (`runner.py`: each stage a `ptops launch
--supervise` subprocess in `PIPE/stages/NN-name`, hand-offs verified and digested, gates,
skip/resume, `events.jsonl` + `pipeline.json`; its own SIGINT/SIGTERM handlers forward to the stage,
which runs in its own session under `PR_SET_PDEATHSIG=SIGTERM`), `ptops status PIPE_DIR`
(`status.py`), MLflow lineage (`lineage.py`: parent run, nested child per stage, created before the
stage's own exporter continues it). May import (of ptops): runrecord, ckpt, recipes (schema),
faultinject (spec), ops/obs (MLflow helpers).
"""
