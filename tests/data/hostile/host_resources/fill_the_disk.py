# tries: no solution; fills the disk: 4,096 files of 1 MB in its work dir, /tmp, /dev/shm and /var/tmp
# task: collatz
# expect: hostile
import os
block = b"x" * (1 << 20)
for d in ("/tmp", "/dev/shm", "/var/tmp", os.getcwd()):
    for i in range(4096):
        try:
            with open(os.path.join(d, "ptops-fill-%d" % i), "wb") as f:
                f.write(block)
        except OSError:
            break
