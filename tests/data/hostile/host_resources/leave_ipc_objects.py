# tries: System V segments, queues and semaphores left on the host (IPC_PRIVATE too)
# task: collatz
# expect: ok
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
KEY = 0x70746F70  # a well-known key: 'ptop'
IPC_CREAT, IPC_NOWAIT = 0o1000, 0o4000

for k in range(8):
    libc.shmget(KEY + k, 1 << 20, IPC_CREAT | 0o666)
    libc.msgget(KEY + k, IPC_CREAT | 0o666)
    libc.semget(KEY + k, 4, IPC_CREAT | 0o666)
libc.shmget(0, 1 << 20, IPC_CREAT | 0o600)  # IPC_PRIVATE, never removed
