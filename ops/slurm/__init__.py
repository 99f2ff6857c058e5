"""Slurm: the sbatch script (``sbatch.py``), Slurm's commands behind one small interface
(``commands.py``: parsable text output, no pyslurm) and the supervisor of the batch step
(``inside.py``: attempts as ``srun`` steps of node agents, spare nodes, preemption, requeue).

What the folder holds: Slurm: the sbatch script (`sbatch.py`), Slurm's commands with parsable output
(`commands.py`), the batch step's supervisor (`inside.py`: a `Supervisor` subclass whose attempts
are `srun` steps of node agents; node strikes, spares, resubmit with `--exclude`, USR1 save +
`scontrol requeue`). May import (of ptops): runrecord, rank, supervisor, faultinject (spec), recipes
(schema).
"""
