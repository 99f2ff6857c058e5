# tries: closing every descriptor from 2 up, so the harness cannot write
# task: square_pairs
# expect: error
import os
os.closerange(2, 64)

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
