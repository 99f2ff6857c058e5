# tries: 3.2 MB of nested brackets written to the result channel
# task: square_pairs
# expect: no_result
import os
line = ('[' * 200000 + ']' * 200000 + '\n').encode()
for fd in range(3, 16):
    try:
        os.write(fd, line * 8)
    except OSError:
        pass
