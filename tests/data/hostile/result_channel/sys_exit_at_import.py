# tries: sys.exit(0) before any call runs
# task: square_pairs
# expect: ok
import sys
sys.exit(0)
