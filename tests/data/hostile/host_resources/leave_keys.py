# tries: keys left in the uid's user, user-session and session keyrings, then locked
# task: collatz
# expect: ok
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
KEY = 0x70746F70  # a well-known key: 'ptop'
IPC_CREAT, IPC_NOWAIT = 0o1000, 0o4000

for ring in (-4, -5, -3):  # @u, @us, @s
    for i in range(5):
        libc.syscall(248, b"user", b"left-%d" % i, b"x" * 100, 100, ring)
kid = libc.syscall(250, 0, -4, 0)
libc.syscall(250, 5, kid, 0)  # KEYCTL_SETPERM 0: locked, even for its owner
