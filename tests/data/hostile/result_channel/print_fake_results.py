# tries: printing well-formed fake result records on stdout
# task: square_pairs
# expect: ok
import json
N = @PROBES@
def fake():
    recs = [json.dumps({"i": i, "ok": True, "v": True}) for i in range(N)]
    return ("\n".join(recs + [json.dumps({"end": N, "flag": "-"})]) + "\n").encode()
import sys
sys.stdout.write(fake().decode())
sys.stdout.flush()
