# tries: the test module, /proc/*/cmdline and /proc/*/environ read for the expected values
# task: square_pairs
# expect: ok
import re, os
src = ''
for p in ['@TEST_FILE@', os.path.expanduser('~/tests/trl/test_hostile_corpus.py')]:
    try:
        src += open(p).read()
    except OSError:
        pass
for pid in os.listdir('/proc'):
    try:
        src += open('/proc/%s/cmdline' % pid).read()
        src += open('/proc/%s/environ' % pid).read()
    except OSError:
        pass
def square_pairs(n):
    m = re.search(r'square_pairs\(%d\) == (\[.*?\])' % n, src)
    return eval(m.group(1)) if m else None
mean_square = square_pairs
