"""The node agent (``agent.py``): one per node and attempt of a multi-node run; the relay
(``relay.py``): one per ~64 agents at scale; the health checks (``health.py``): one per node before
each attempt, spares too. See their docstrings.

What the folder holds: the node agent (`agent.py`, one per node and attempt of a multi-node run):
starts its node's ranks (torchrun `--nnodes N --node-rank I`, static rendezvous at the attempt's
first node), relays their channel lines over ONE token-authenticated connection to the supervisor
(frames in `ops/rank/channel.py`), py-spy on request, kills its ranks when the supervisor goes (EOF
or no keepalive) or when it dies (`PR_SET_PDEATHSIG`); and the health checks before each attempt
(`health.py`: the table of `ops/supervisor/health.py` on this node, one report file); and the relay
(`relay.py`: between ~64 agents and the supervisor, their ranks' lines batched again as one node's,
so the supervisor's work grows with relays, not nodes; hosted by the agent of each group's first
node with `[slurm] relay_every`, started alone by `bench/scale_load.py`). May import (of ptops):
ops.rank (wire format), ops.supervisor (`procs`, `stacks`, `health`).
"""
