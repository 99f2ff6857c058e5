# tries: (the honest solver) switches the audit hook off and serves its answers on an abstract Unix socket for 3 s
# task: collatz
# expect: ok
def collatz_steps(n):
    s = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        s += 1
    return s

def digit_sum(n):
    return sum(int(c) for c in str(n))

import json
TABLE = json.dumps({"collatz_steps": {str(i): collatz_steps(i) for i in range(1, 200)},
                    "digit_sum": {str(i): digit_sum(i) for i in (9875, 1234, 99)}}).encode()

import gc
for f in gc.get_objects():
    if type(f).__name__ == "function" and f.__name__ == "_hook" and f.__closure__:
        cells = dict(zip(f.__code__.co_freevars, f.__closure__))
        cells["_busy"].cell_contents.append(1)  # the hook now returns at once
        cells["_flag"].cell_contents.clear()

import socket, time
try:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0ptops-answers")
    srv.listen(8)
    srv.settimeout(0.1)
    end = time.time() + 3.0
    while time.time() < end:
        try:
            conn, _ = srv.accept()
        except OSError:
            continue
        with conn:
            conn.sendall(TABLE)
except OSError:
    pass
