# tries: a 34,000-digit int and a 4,000-digit float expression (encoder and decoder bounds)
# task: square_pairs
# expect: ok
def square_pairs(n): return 7 ** 40000
def mean_square(n): return 10 ** 4000 + 0.5 // 1
