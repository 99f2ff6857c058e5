# tries: sys.settrace rewriting the harness's records in its frames
# task: square_pairs
# expect: ok|malformed|error|no_result
import sys
def tr(frame, event, arg):
    if '_rec' in frame.f_locals:
        r = frame.f_locals['_rec']
        if isinstance(r, dict):
            r['ok'] = True
            r['v'] = [[0, 0], [1, 1]]
    return tr
sys.settrace(tr)
def square_pairs(n): return None
mean_square = square_pairs
