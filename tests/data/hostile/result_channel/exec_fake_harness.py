# tries: exec of a new interpreter that writes fake records
# task: square_pairs
# expect: hostile
import json
N = @PROBES@
def fake():
    recs = [json.dumps({"i": i, "ok": True, "v": True}) for i in range(N)]
    return ("\n".join(recs + [json.dumps({"end": N, "flag": "-"})]) + "\n").encode()
import os, sys
prog = 'import os, sys; os.write(3, ' + repr(fake()) + ')'
os.execv(sys.executable, [sys.executable, '-c', prog])
