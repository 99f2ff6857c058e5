# tries: files in /tmp, /dev/shm, /var/tmp and a double-forked daemon
# task: collatz
# expect: hostile
import os, time
for d in ("/tmp", "/dev/shm", "/var/tmp", os.getcwd()):
    try:
        open(os.path.join(d, "ptops-left-behind"), "w").write("x")
    except OSError:
        pass
try:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
except OSError:
    pass
