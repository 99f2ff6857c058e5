# tries: a BaseException subclass raised at import
# task: square_pairs
# expect: ok
class Stop(BaseException):
    pass
raise Stop()
