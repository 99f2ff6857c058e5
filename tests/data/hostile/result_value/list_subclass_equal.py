# tries: list/tuple/str subclasses whose __eq__ always returns True
# task: square_pairs
# expect: ok
class L(list):
    def __eq__(self, o): return True
class T(tuple):
    def __eq__(self, o): return True
    __hash__ = tuple.__hash__
def square_pairs(n): return L([T((0, 0)), T((1, 1))])
class S(str):
    def __eq__(self, o): return True
    __hash__ = str.__hash__
def mean_square(n): return S('x')
