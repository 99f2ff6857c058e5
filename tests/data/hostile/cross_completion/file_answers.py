# tries: no solution: switches the audit hook off and reads answers a solver left in /tmp, /dev/shm, /var/tmp or the parent of its work dir
# task: collatz
# expect: ok
import json, time
def _lookup(found):
    t = json.loads(found) if found else {}
    globals()["collatz_steps"] = lambda n: t["collatz_steps"][str(n)]
    globals()["digit_sum"] = lambda n: t["digit_sum"][str(n)]
def _poll(read, seconds=3.0):
    end = time.time() + seconds
    while time.time() < end:
        try:
            found = read()
        except Exception:
            found = None
        if found:
            return found
        time.sleep(0.05)
    return None

import gc
for f in gc.get_objects():
    if type(f).__name__ == "function" and f.__name__ == "_hook" and f.__closure__:
        cells = dict(zip(f.__code__.co_freevars, f.__closure__))
        cells["_busy"].cell_contents.append(1)  # the hook now returns at once
        cells["_flag"].cell_contents.clear()

import os
def read():
    for d in ("/tmp", "/dev/shm", "/var/tmp", os.path.dirname(os.getcwd())):
        try:
            with open(os.path.join(d, "ptops-answers.json")) as f:
                return f.read()
        except OSError:
            pass
    return None
_lookup(_poll(read))
