"""What the folder holds: code inside the training processes: the probe, the channel client and wire
format, the rank entry point, the profile capture (`profiler.py`), the warm pool that forks ready
ranks for restarts (`warm.py`) and the light launcher that asks it for a restart's ranks in place of
torchrun (`warmlaunch.py`). May import (of ptops): runrecord, faultinject, recipes (entry: the
engine registry).
"""

import sys

# how torchrun (``--no-python``) starts each rank: ``-P`` keeps the cwd off sys.path, so a folder
# named ``ptops`` there (a checkout) cannot shadow the installed package; ``-u``: unbuffered logs
RANK_PYTHON = (sys.executable, "-P", "-u", "-m", "ptops.ops.rank.entry")
