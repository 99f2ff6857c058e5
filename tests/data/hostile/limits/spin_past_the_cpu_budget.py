# tries: the honest solution, then spinning past the CPU budget in one process
# task: collatz
# expect: killed|timeout
def collatz_steps(n):
    s = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        s += 1
    return s

def digit_sum(n):
    return sum(int(c) for c in str(n))

while True:
    pass
