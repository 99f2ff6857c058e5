"""The ``PTOPS_*`` environment variables that cross a process boundary, each named once.

Why: they are a protocol between processes (the supervisor, the node agents and relays, the ranks,
the warm pools, the CLI and the user's shell); a name misspelt on one side shows only at run time,
so every side takes it from here. The names themselves are a contract with user scripts and docs:
never rename one. Imports nothing, so that every process, the fastest-starting included, may
import it. The two leaves that import nothing of ptops spell their own: ``ckpt``'s ``RESUME_ENV``
(:data:`RESUME_FROM`) and ``ops/runrecord/cache.py``'s ``CACHE_ENV`` (:data:`CACHE`);
``tests/install/test_envnames.py`` checks they are equal.

Each line: who writes it -> who reads it: what it means.
"""

# --- supervisor -> ranks (every attempt's environment: ops/supervisor/launcher.py, attempt.py)
RUN_DIR = "PTOPS_RUN_DIR"  # launcher -> ranks, recipes, warm children: the run directory; the
# supervisor's sweeps (ops/supervisor/procs.py) find a run's processes by it in /proc/PID/environ
ATTEMPT = "PTOPS_ATTEMPT"  # launcher -> ranks (probe), node agent, relay: the attempt number
CHANNEL = "PTOPS_CHANNEL"  # attempt -> agent (upstream); agent -> its ranks: channel HOST:PORT
CHANNEL_TOKEN = "PTOPS_CHANNEL_TOKEN"  # with CHANNEL, same writers and readers: its token
SUPERVISOR_PID = "PTOPS_SUPERVISOR_PID"  # attempt -> ranks (entry: ptracer; fault injector)
PTRACER_PID = "PTOPS_PTRACER_PID"  # node agent -> its ranks (entry): who may ptrace (py-spy)
HEARTBEAT_S = "PTOPS_HEARTBEAT_S"  # attempt -> probe: seconds between liveness pings
FAULTS = "PTOPS_FAULTS"  # attempt (or a bench) -> probe's fault injector: fault specs, JSON
ROLLBACK = "PTOPS_ROLLBACK"  # policy (attempt_env) -> engine adapters (recipes/rollback.py)
RESUME_FROM = "PTOPS_RESUME_FROM"  # attempt -> ckpt.resume_point in ranks: verified checkpoint
# path ("" = fresh start); ckpt/lifecycle.py spells it as RESUME_ENV (ckpt imports no ptops)
RANK_LOGS = "PTOPS_RANK_LOGS"  # user/tests -> rank entry: "0" keeps rank output on stdout

# --- node agents and relays (ops/node; written by ops/supervisor/launcher.py, ops/slurm/inside.py)
NODE_SUMMARY = "PTOPS_NODE_SUMMARY"  # attempt -> agent, relay: node_summaries settings, JSON
RELAYS = "PTOPS_RELAYS"  # Slurm attempt -> agent: relay groups ([slurm] relay_every), JSON
NODE_ARGV = "PTOPS_NODE_ARGV"  # local launcher -> agent: the launcher's argv, JSON list
NODE_LOG = "PTOPS_NODE_LOG"  # local launcher -> agent: the path of the launcher's log
NODE_NPROC = "PTOPS_NODE_NPROC"  # launcher, Slurm attempt -> agent: ranks on this node
NODE_NNODES = "PTOPS_NODE_NNODES"  # launcher, Slurm attempt -> agent: nodes in the attempt
NODE_RANK = "PTOPS_NODE_RANK"  # local launcher -> agent: this node's rank (Slurm: SLURM_NODEID)
NODE_MASTER = "PTOPS_NODE_MASTER"  # Slurm attempt -> agent: torchrun's rendezvous host
NODE_PORT = "PTOPS_NODE_PORT"  # Slurm attempt -> agent: torchrun's rendezvous port
NODE_LOG_DIR = "PTOPS_NODE_LOG_DIR"  # Slurm attempt -> agent: the attempt's log folder
NODE_UPSTREAM_TIMEOUT_S = "PTOPS_NODE_UPSTREAM_TIMEOUT_S"  # Slurm attempt -> agent, relay:
# seconds of upstream silence after which they stop ([slurm] upstream_timeout_s)
NODE = "PTOPS_NODE"  # node agent -> its ranks: the node's host name
RELAY_LISTEN = "PTOPS_RELAY_LISTEN"  # agent hosting a relay (or a bench) -> relay: HOST:PORT
RELAY_HOLD_S = "PTOPS_RELAY_HOLD_S"  # user -> relay: how long a step's pieces wait for the rest
HEALTH = "PTOPS_HEALTH"  # Slurm attempt -> ops/node/health.py on each node: the checks, JSON
HEALTH_TOKEN = "PTOPS_HEALTH_TOKEN"  # with HEALTH: the token of the supervisor's clock server

# --- warm pools (ops/rank/warm.py, ops/supervisor/warmpool.py, ptops warm)
WARM_SOCKET = "PTOPS_WARM_SOCKET"  # supervisor's WarmPool -> ranks, warmlaunch: pool's socket
WARM_POOL = "PTOPS_WARM_POOL"  # warm pool -> each forked child (entry): the pool's pid
STANDING_POOL = "PTOPS_STANDING_POOL"  # user (after ptops warm) -> supervisor, warmrun: its name
ENVIRON_SLOT = "PTOPS_ENVIRON_SLOT"  # warm pool's exec env -> its children: a placeholder they
# overwrite with their run's RUN_DIR (ops/rank/environslot.py)

# --- sidecars (ops/supervisor/sidecar.py)
SIDECAR_OF = "PTOPS_SIDECAR_OF"  # supervisor -> sidecars: owning run dir (leftovers are swept)
SIDECAR_GRACE_S = "PTOPS_SIDECAR_GRACE_S"  # user -> supervisor: seconds a sidecar gets to stop

# --- knobs a user sets in the shell, read by ptops' processes
CACHE = "PTOPS_CACHE"  # user -> every process: the asset cache folder (~/.cache/ptops)
MLFLOW = "PTOPS_MLFLOW"  # user -> ptops launch, ptops pipeline: "0" turns MLflow off
RUNBOOK_BASE_URL = "PTOPS_RUNBOOK_BASE_URL"  # user -> alert rules: runbook_url base
DRYRUN_TIMEOUT_S = "PTOPS_DRYRUN_TIMEOUT_S"  # user -> ptops launch --dry-run: its time limit
DRYRUN_MATERIALIZE = "PTOPS_DRYRUN_MATERIALIZE"  # user -> titan dry run: "1" builds weights
TITAN_ARGS = "PTOPS_TITAN_ARGS"  # user -> titan ranks: extra torchtitan flags (shlex split)
CKPT_QKV_SPLIT = "PTOPS_CKPT_QKV_SPLIT"  # user -> titan checkpointing: "inline", torchtitan's hook

# --- not an environment variable: the line a dry-run subprocess prints for the CLI to parse
DRYRUN_LINE = "PTOPS_DRYRUN"  # recipes/*/dryrun.py stdout -> ops/cli/dryrun*.py
