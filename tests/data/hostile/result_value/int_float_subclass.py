# tries: int and float subclasses whose __eq__ always returns True
# task: square_pairs
# expect: ok
class F(float):
    def __eq__(self, o): return True
    __hash__ = float.__hash__
    def __sub__(self, o): return 0.0
class I(int):
    def __eq__(self, o): return True
    __hash__ = int.__hash__
def square_pairs(n): return I(1)
def mean_square(n): return F(0.0)
