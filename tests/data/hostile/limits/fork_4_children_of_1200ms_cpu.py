# tries: the honest solution plus 4 forked children of 1.2 s CPU each (a per-process CPU limit x 4)
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
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        end = time.process_time() + 1.2
        while time.process_time() < end:
            pass
        os._exit(0)
    kids.append(pid)
for p in kids:
    os.waitpid(p, 0)
