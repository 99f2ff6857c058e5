# tries: no solution: reads the answers a solver published through a System V shared-memory segment under a well-known key
# task: collatz
# expect: ok
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
KEY = 0x70746F70  # a well-known key: 'ptop'
IPC_CREAT, IPC_NOWAIT = 0o1000, 0o4000

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

def read():
    sid = libc.shmget(KEY, 0, 0)
    if sid < 0:
        return None
    return ctypes.string_at(libc.shmat(sid, None, 0)).decode()
_lookup(_poll(read))
