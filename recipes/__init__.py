"""What the folder holds: recipe TOMLs (pipeline files in `pipelines/`), the schema (`schema.py`;
`[eval]`, `train.init_from`), where a run's initial weights come from (`init_from.py`: verified
checkpoint, weights only), the TRL held-out eval (`trl/evalloop.py`), rejection sampling
(`trl/rejection.py`: best of N by the verifier -> SFT rows for `train.data_file`), the engine
registry (`engines.py`: ptops' own engines, then plugins of the `ptops.engines` entry point group),
engine adapters that register themselves (`titan/`, `trl/`; they get the probe as an argument;
`script/`: a user's own command, `ptops launch -- python train.py`: a Python script runs in the rank
process via `runpy`, each optimizer step a step through torch's global optimizer hooks unless it
uses `ptops.rank`, which `script/run.py` binds to the probe; another program runs as a child;
`Engine.complete_on_exit`: exit 0 on every rank completes the run), local assets (`assets.py`: every
cached asset through `build_once`: one builder under a file lock, checked by loading before a
manifest marks it complete; an entry that does not match its manifest is quarantined), the rollback
contract (`rollback.py`), where a rank resumes (`resume.py`: `ptops.ckpt.resume_point` with its
findings reported); the planner (`plan.py`: pure, imports nothing, sizes titan recipes for `ptops
plan` and `--dry-run`; `plan_rl.py`: rollout capacity of GRPO recipes, imports only `plan.py`); the
titan fake-backend dry run (`titan/dryrun.py`, a subprocess of `--dry-run`); TRL: the adapter
(`trl/run.py`), the catalogue trainers (`trl/catalogue.py`: LoRA SFT, reward, RLOO, GKD and its
pinned teacher), `[trl.vllm]` options and the vLLM sidecar spec (`trl/vllm.py`, light), the
meta-device dry run (`trl/dryrun.py`, a subprocess of `--dry-run`). May import (of ptops):
ops.runrecord, ckpt, monitors (config models); `script/run.py` also ptops.rank; `plan.py`: nothing.
"""
