# tries: the honest solution, then 3 children of 100 MB each forked from a grandchild in a new session (out of the harness's process group)
# task: collatz
# expect: killed
def collatz_steps(n):
    s = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        s += 1
    return s

def digit_sum(n):
    return sum(int(c) for c in str(n))

import os, time
if os.fork() == 0:
    os.setsid()
    for _ in range(3):
        if os.fork() == 0:
            b = bytearray(100 * 1024 * 1024)
            for i in range(0, len(b), 4096):
                b[i] = 1
            time.sleep(2)
            os._exit(0)
    time.sleep(2.5)
    os._exit(0)
time.sleep(2.5)
