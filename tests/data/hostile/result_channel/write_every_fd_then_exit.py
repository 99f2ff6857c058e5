# tries: fake records written to descriptors 0-63, then os._exit(0)
# task: square_pairs
# expect: ok
import json
N = @PROBES@
def fake():
    recs = [json.dumps({"i": i, "ok": True, "v": True}) for i in range(N)]
    return ("\n".join(recs + [json.dumps({"end": N, "flag": "-"})]) + "\n").encode()
import os
for fd in range(0, 64):
    try:
        os.write(fd, fake())
    except OSError:
        pass
os._exit(0)
