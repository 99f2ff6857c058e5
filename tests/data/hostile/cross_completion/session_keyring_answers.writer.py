# tries: (the honest solver) publishes its answers through a key in the session keyring every sandbox inherited
# task: collatz
# expect: ok
def collatz_steps(n):
    s = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        s += 1
    return s

def digit_sum(n):
    return sum(int(c) for c in str(n))

import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
KEY = 0x70746F70  # a well-known key: 'ptop'
IPC_CREAT, IPC_NOWAIT = 0o1000, 0o4000

import json
TABLE = json.dumps({"collatz_steps": {str(i): collatz_steps(i) for i in range(1, 200)},
                    "digit_sum": {str(i): digit_sum(i) for i in (9875, 1234, 99)}}).encode()

libc.syscall(248, b"user", b"ptops-answers", TABLE, len(TABLE), -3)  # add_key(.., @s)
