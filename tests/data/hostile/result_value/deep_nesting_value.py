# tries: a list nested 100,000 deep
# task: square_pairs
# expect: ok
def square_pairs(n):
    x = []
    for _ in range(100000):
        x = [x]
    return x
mean_square = square_pairs
