# tries: os._exit(0) before the harness writes anything
# task: square_pairs
# expect: no_result
import os
os._exit(0)
