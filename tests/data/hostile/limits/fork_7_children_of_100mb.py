# tries: the honest solution plus 7 forked children of 100 MB each (a per-process memory limit x 7)
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
kids = []
for _ in range(7):
    pid = os.fork()
    if pid == 0:
        b = bytearray(100 * 1024 * 1024)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
for p in kids:
    os.waitpid(p, 0)
