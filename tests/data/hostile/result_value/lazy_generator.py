# tries: generators and map objects of always-equal objects (lazy values)
# task: square_pairs
# expect: ok
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
def square_pairs(n): return (x for x in [Always(), Always()])
def mean_square(n): return map(lambda x: Always(), [n])
