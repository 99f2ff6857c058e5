# tries: a SIGALRM handler that raises SystemExit in the middle of the calls
# task: square_pairs
# expect: ok|malformed|error|no_result
import signal, sys
def stop(*_):
    raise SystemExit(0)
signal.signal(signal.SIGALRM, stop)
signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)

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
def square_pairs(n):
    import time; time.sleep(0.05); return Always()
mean_square = square_pairs
