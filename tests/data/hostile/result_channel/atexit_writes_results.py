# tries: an atexit handler that writes fake result records to every descriptor
# task: square_pairs
# expect: ok
import json
N = @PROBES@
def fake():
    recs = [json.dumps({"i": i, "ok": True, "v": True}) for i in range(N)]
    return ("\n".join(recs + [json.dumps({"end": N, "flag": "-"})]) + "\n").encode()
import atexit, os
atexit.register(lambda: [os.write(fd, fake()) for fd in range(1, 20)])
import sys
sys.exit(0)
