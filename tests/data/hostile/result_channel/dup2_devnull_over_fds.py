# tries: /dev/null dup2'ed over every descriptor
# task: square_pairs
# expect: no_result
import os
z = os.open('/dev/null', os.O_WRONLY)
for fd in range(1, 64):
    if fd != z:
        try:
            os.dup2(z, fd)
        except OSError:
            pass
