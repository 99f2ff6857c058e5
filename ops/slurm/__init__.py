"""Slurm: the sbatch script (``sbatch.py``), Slurm's commands behind one small interface
(``commands.py``: parsable text output, no pyslurm) and the supervisor of the batch step
(``inside.py``: attempts as ``srun`` steps of node agents, spare nodes, preemption, requeue)."""
