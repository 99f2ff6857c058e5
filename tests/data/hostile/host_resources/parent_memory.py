# tries: /proc/1/mem, the parent's and its own memory read
# task: square_pairs
# expect: ok
import os
raw = b''
for pid in ['1', str(os.getppid()), 'self']:
    try:
        with open('/proc/%s/mem' % pid, 'rb') as f:
            raw += f.read(1 << 20)
    except (OSError, ValueError):
        pass
def square_pairs(n): return raw or None
mean_square = square_pairs
