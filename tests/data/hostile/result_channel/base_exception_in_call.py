# tries: BaseException subclasses (and KeyboardInterrupt) raised inside the calls
# task: square_pairs
# expect: ok
class Stop(BaseException):
    pass
def square_pairs(n): raise Stop()
def mean_square(n): raise KeyboardInterrupt
