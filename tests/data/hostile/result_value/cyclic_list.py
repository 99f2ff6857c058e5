# tries: a list that contains itself
# task: square_pairs
# expect: ok
def square_pairs(n):
    x = []
    x.append(x)
    return x
mean_square = square_pairs
