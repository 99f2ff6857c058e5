# tries: a thread that floods descriptors 3-15 with fake records during the calls
# task: square_pairs
# expect: ok|malformed|error|no_result
import json
N = @PROBES@
def fake():
    recs = [json.dumps({"i": i, "ok": True, "v": True}) for i in range(N)]
    return ("\n".join(recs + [json.dumps({"end": N, "flag": "-"})]) + "\n").encode()
import os, threading, time
def spam():
    while True:
        for fd in range(3, 16):
            try:
                os.write(fd, fake())
            except OSError:
                pass
        time.sleep(0.001)
threading.Thread(target=spam, daemon=True).start()

class Always:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __le__(self, other): return True
    def __hash__(self): return 0
    def __bool__(self): return True
    def __len__(self): return 1
    def __iter__(self): return iter([self])
    def __getitem__(self, i): return self
    def __sub__(self, other): return 0.0
    def __rsub__(self, other): return 0.0
    def __abs__(self): return 0.0
    def __float__(self): return 0.0
    def __contains__(self, x): return True
def square_pairs(n): return Always()
mean_square = square_pairs
