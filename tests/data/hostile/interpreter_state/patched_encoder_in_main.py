# tries: the harness's own encoder replaced through __main__ and _main.__defaults__
# task: square_pairs
# expect: ok
import sys
m = sys.modules['__main__']
def enc(v, d, n):
    return True
m._enc = enc
d = list(m._main.__defaults__)
d[-1] = enc
m._main.__defaults__ = tuple(d)
def square_pairs(n): return object()
mean_square = square_pairs
