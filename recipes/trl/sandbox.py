"""Run a model's Python completion against test asserts, isolated: the GRPO ``code`` reward.

Reward = passed asserts / all asserts. The grader is built so that a completion can make itself
fail, never pass, whatever it does to its own interpreter: each assert is split where the data loads
(:func:`split_assert`) into its call (``f(x)``, run inside) and its expected value (kept here); the
sandbox runs the completion, then each call, and sends each result as plain data; the parent decodes
it with a strict whitelist and compares it here. A crash, an exit, a kill, a limit hit (CPU, memory,
processes, wall clock) or a broken result channel score 0, so the outcome depends on the code only and
not on timing (a program near its CPU limit is the exception).

Forgeries (a policy optimises what the grader pays for). Each is an entry of the hostile corpus
(``tests/data/hostile/``, run by ``tests/trl/test_hostile_corpus.py``) unless a ``test_`` is named;
``docs/rewards.md`` has the same table:

==========================  ========================================  =================================
forgery                     what stops it                             test
==========================  ========================================  =================================
an object equal to          the comparison runs here on decoded       always_equal_object,
anything; a subclass of     data; the encoder inside and the          int_float_subclass,
int/str/list/tuple;         decoder here take exact types only        list_subclass_equal,
``__class__`` spoofing      (``type(v) is int``, never isinstance)    class_spoofing
a lazy, huge, cyclic,       bounded: depth 16, 10,000 nodes, ~1,000   lazy_generator, huge_int,
deep or non-finite value    digits, 10,000 characters, finite         cyclic_list, deep_nesting_value,
                            floats; beyond them the check fails       nan_and_inf, test_decoder_refuses
an early exit (sys.exit,    missing results are no pass; the          os_exit_at_import,
os._exit, BaseException     harness ends with os._exit (no atexit);   sys_exit_at_import,
subclasses, atexit)         a module that raises fails all checks     base_exception_*, atexit_*
fake result lines           stdout/stderr go to /dev/null; one        print_fake_results,
(printed, on any fd, from   record per call, in order, and an end     write_every_fd_*,
threads, a forked child,    record, nothing else (else void); a       thread_floods_channel,
an exec'd program)          record is a claim that must equal the     fork_child_writes_late,
                            expected value; exec is refused           exec_fake_harness
patching the harness        its references are bound before the       patched_json_dumps,
(json, the encoder,         completion runs; a patch that reaches     patched_encoder_in_main,
builtins, settrace)         them only changes what is claimed         builtins_patched, settrace_*
closing or dup2 over fds,   the results do not arrive: no pass        close_result_fds,
a signal handler exiting                                              dup2_devnull_over_fds,
                                                                      signal_exits_harness
reading the expected        never in the sandbox (program, argv,      frame_and_heap_scan,
values (frames, heap,       env, stdin); a root of its own            argv_env_stdin_scan,
argv/env, files, /proc,     (``isolation.fs == "private"``: no        read_the_test_file,
parent memory)              repository, cache or data), pid ns, uid   parent_memory
hard-coding the prompt's    graded tests are hidden:                  test_hard_coding_the_shown_*,
examples                    ``check_code_rows`` refuses a shown one   test_code_rows_refuse_*
an assert that would        refused when the data loads               test_split_assert_refuses
compare inside (``==
True``, ``bool()``,
arithmetic, !=, orders)
==========================  ========================================  =================================

Known limits: without a mount namespace (no user namespaces, or unshare refused:
``isolation.fs == "host"``) the completion can read whatever the trainer's uid can, so expected values
in a readable data file could be looked up; a bare ``assert f(x)`` or ``f(x) in (..)`` pays for any
truthy value or member, as weak as the data makes it.

What a completion can do to the host, and what stops it:

=====================  =============================================================
fork bomb              RLIMIT_NPROC for a uid of its own (so concurrent sandboxes of the
                       two ranks never share the count), a fresh pid namespace whose init is
                       the harness (all of it dies with the harness), and a ``kill(-1)`` as
                       that uid afterwards (nothing of it outlives the call)
infinite loop          RLIMIT_CPU (SIGXCPU then SIGKILL) and a wall-clock kill
memory bomb            RLIMIT_AS
forked limits          a cgroup per completion, made here before the harness starts and
                       removed after (v1 memory/memsw, pids, cpu quota, cpuacct; or v2):
                       memory_mb, max_procs and cpu_s hold for all its processes together;
                       an OOM kill or the CPU budget in it scores 0 (``killed``)
other completions      an IPC namespace (System V IPC, POSIX mqueues), a UTS and a cgroup
                       namespace each; a fresh session keyring (not the trainer's); a user
                       namespace for the harness (uid mapped to itself), so the keyrings its
                       uid creates die with it instead of staying on the host
the guard itself       the audit hook lives in the completion's interpreter and can be
                       switched off: where the kernel refuses a namespace the verdict relies
                       on (:func:`weak_isolation`), nothing is run (``refused``) unless
                       ``allow_weak_isolation``; with the namespaces the kernel enforces
``rm -rf`` / writes    an unprivileged uid that owns nothing but its private work dir
                       (cwd, HOME, TMPDIR); a private mount namespace with tmpfs /tmp,
                       /var/tmp, /dev/shm (size-limited, gone at exit) and a root of its own
                       (read-only, nosuid binds of /usr and the interpreter); RLIMIT_FSIZE
network                a fresh network namespace (no interface up, not even loopback);
                       where namespaces are not permitted, an audit hook in the harness
                       that refuses ``socket.*``, ``subprocess``/``exec``/``spawn`` and
                       ``ctypes`` (no seccomp: a weaker guard, reported as such)
signals to the trainer the parent is outside the pid namespace (``getppid()`` is 0) and
                       of another uid (EPERM)
=====================  =============================================================

Not root: no uid of its own, but an unprivileged user namespace still gives the network, pid and
mount namespaces (``userns``) and the same root of its own (the trainer's uid maps to itself, so the
harness has no capability left after exec to leave it); without user namespaces the files are the
trainer's and only the audit hook guards them. RLIMIT_NPROC is then the trainer's own task count +
``max_procs``.

Which isolation was used is reported in every result (``isolation``) and by the
trainer's ``reward_source`` event. The launcher (this file run as a script, standard
library only) is a separate process because the training rank is multi-threaded: namespaces
and uids are set in a fresh single-threaded process, never with ``preexec_fn``.
"""  # noqa: E501

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

# clone(2) flags and mount(2) flags (linux/sched.h, linux/mount.h)
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 32, 4096, 0x4000, 1 << 18, 1 << 21
ST_NOATIME, ST_NODIRATIME, ST_RELATIME = (
    1024,
    2048,
    4096,
)  # statvfs f_flag bits (the MS_ values but relatime)
PR_SET_PDEATHSIG = 1
MNT_DETACH = 2
KEYCTL_JOIN_SESSION_KEYRING = 1
# syscalls without a libc wrapper everywhere: pivot_root(2), keyctl(2)
SYSCALLS = {
    "x86_64": {"pivot_root": 155, "keyctl": 250},
    "aarch64": {"pivot_root": 41, "keyctl": 219},
}
UID_BASE = 200_000  # sandbox uid = UID_BASE + the launcher's pid: unique among live sandboxes
OUTPUT_CAP = 1024 * 1024  # the harness's result records; beyond it the run is void


@dataclass(frozen=True)
class Limits:
    """Per-completion limits (``[trl.sandbox]``)."""

    cpu_s: int = 2
    wall_s: float = 10.0
    memory_mb: int = 512
    max_procs: int = 16
    file_mb: int = 8
    # where the kernel refuses the namespaces, grade anyway with the audit hook alone (a guard that
    # lives in the completion's interpreter: it can be found and switched off). False: refuse.
    allow_weak_isolation: bool = False


@dataclass
class Result:
    passed: int = 0
    total: int = 0
    # ok | error (the harness ran, code raised) | killed (a signal, or a limit of its cgroup) |
    # timeout | no_result | malformed | hostile | refused (the kernel refused the isolation)
    status: str = "ok"
    reward: float = 0.0
    isolation: dict = field(default_factory=dict)
    detail: str = ""
    wall_s: float = 0.0  # launcher-measured, harness start to reap
    usage: dict = field(default_factory=dict)  # the completion's cgroup, measured from outside


# what a result may be: plain data of exact types, bounded (the encoder inside and the decoder
# outside)
MAX_DEPTH = 16
MAX_NODES = 10_000
MAX_STR = 10_000
MAX_INT_BITS = 3_400  # ~1,000 decimal digits
MAX_INT_DIGITS = 1_024


# ----------------------------------------------------------- asserts: call inside, expected outside


class AssertRefused(ValueError):
    """A test assert the grader cannot split into a call (run inside) and an expected value (kept
    outside): refused when the data loads, never run and trusted."""


@dataclass(frozen=True)
class Clause:
    """One check of an assert: ``probe`` (source run inside the sandbox) and how its decoded value
    is judged outside: ``eq`` / ``is`` / ``in`` against ``expected``, ``truthy`` / ``falsy``, or
    ``close`` (``math.isclose`` with ``tol`` = (rel_tol, abs_tol), or ``abs(probe - expected) <
    tol[1]``)."""

    probe: str
    kind: str
    expected: object = None
    tol: tuple = ()


_WRAPS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "sorted": sorted}
_SAFE_INSIDE = (
    "Call",
    "Name",
    "Attribute",
    "Subscript",
    "Slice",
    "keyword",
    "Starred",
    "Constant",
    "Tuple",
    "List",
    "Set",
    "Dict",
    "Load",
    "BinOp",
    "UnaryOp",
)
_REACHES = ("Name", "Call", "Attribute", "Subscript")


class _NotExpected(Exception):
    pass


def plain_ok(v, depth: int = 0, _count: list | None = None) -> bool:
    """Whether ``v`` is plain data of the whitelist (exact types, bounded depth, size, digits;
    finite)."""
    import math

    count = _count if _count is not None else [0]
    count[0] += 1
    if depth > MAX_DEPTH or count[0] > MAX_NODES:
        return False
    t = type(v)
    if v is None or t is bool:
        return True
    if t is int:
        return v.bit_length() <= MAX_INT_BITS
    if t is float:
        return math.isfinite(v)
    if t in (str, bytes):
        return len(v) <= MAX_STR
    if t in (list, tuple, set, frozenset):
        return all(plain_ok(x, depth + 1, count) for x in v)
    if t is dict:
        return all(
            plain_ok(k, depth + 1, count) and plain_ok(x, depth + 1, count) for k, x in v.items()
        )
    return False


def _expected(node):
    """The expected side's value, computed here (never in the sandbox): a literal, or set/frozenset/
    tuple/list/sorted of one."""
    import ast

    args = [node]
    wrap = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _WRAPS:
        if node.keywords or len(node.args) > 1:
            raise _NotExpected
        wrap, args = _WRAPS[node.func.id], node.args
    try:
        vals = [ast.literal_eval(a) for a in args]
        v = wrap(*vals) if wrap else vals[0]
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _NotExpected from None
    if not plain_ok(v):
        raise AssertRefused(
            f"the expected value {ast.unparse(node)[:80]} is not plain bounded data"
        )
    return v


def _inside(node, src: str) -> str:
    """The probe's source, after checking that nothing in it compares or computes with a value the
    completion controls (that would move the comparison, and the expected value, into the
    sandbox)."""
    import ast

    for sub in ast.walk(node):
        name = type(sub).__name__
        if isinstance(sub, (ast.expr_context, ast.operator, ast.unaryop)):
            continue
        if name not in _SAFE_INSIDE:
            raise AssertRefused(
                f"cannot grade {src!r}: {name} in the checked expression would run inside "
                "the sandbox"
            )
        reaches = isinstance(sub, (ast.BinOp, ast.UnaryOp)) and any(
            type(x).__name__ in _REACHES for x in ast.walk(sub)
        )
        if reaches:
            raise AssertRefused(
                f"cannot grade {src!r}: arithmetic on a value the completion controls"
            )
    return ast.unparse(node)


def _clauses(node, src: str) -> list[Clause]:
    import ast

    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return [c for v in node.values for c in _clauses(v, src)]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [Clause(_inside(node.operand, src), "falsy")]
    if isinstance(node, ast.Compare):
        if len(node.ops) != 1:
            raise AssertRefused(f"cannot grade {src!r}: a chained comparison")
        left, op, right = node.left, node.ops[0], node.comparators[0]
        if isinstance(op, ast.Eq):
            try:
                return [Clause(_inside(left, src), "eq", _expected(right))]
            except _NotExpected:
                pass
            try:
                return [Clause(_inside(right, src), "eq", _expected(left))]
            except _NotExpected:
                why = "neither side of == is a literal expected value"
                raise AssertRefused(f"cannot grade {src!r}: {why}") from None
        singleton = isinstance(right, ast.Constant) and any(
            right.value is k for k in (None, True, False)
        )
        if isinstance(op, ast.Is) and singleton:
            return [Clause(_inside(left, src), "is", right.value)]
        if isinstance(op, ast.In):
            try:
                return [Clause(_inside(left, src), "in", _expected(right))]
            except _NotExpected:
                raise AssertRefused(
                    f"cannot grade {src!r}: `in` needs a literal container"
                ) from None
        is_abs = (
            isinstance(left, ast.Call)
            and isinstance(left.func, ast.Name)
            and left.func.id == "abs"
            and len(left.args) == 1
            and not left.keywords
        )
        if (
            isinstance(op, (ast.Lt, ast.LtE))
            and is_abs
            and isinstance(left.args[0], ast.BinOp)
            and isinstance(left.args[0].op, ast.Sub)
        ):
            a, b = left.args[0].left, left.args[0].right
            try:
                tol = _expected(right)
                try:
                    probe, want = _inside(a, src), _expected(b)
                except _NotExpected:
                    probe, want = _inside(b, src), _expected(a)
            except _NotExpected:
                why = "abs(x - y) < tol needs a literal y and tol"
                raise AssertRefused(f"cannot grade {src!r}: {why}") from None
            if not all(type(x) in (int, float) for x in (tol, want)):
                raise AssertRefused(f"cannot grade {src!r}: a tolerance check on non-numbers")
            return [Clause(probe, "close", want, ("lt" if isinstance(op, ast.Lt) else "le", tol))]
        raise AssertRefused(
            f"cannot grade {src!r}: only ==, `is` None/True/False, `in` and "
            "abs(x - y) < tol comparisons (an `!=` or an order pays for a wrong answer)"
        )
    if isinstance(node, ast.Call) and _is_isclose(node.func):
        kw = {k.arg: k.value for k in node.keywords}
        if len(node.args) != 2 or set(kw) - {"rel_tol", "abs_tol"}:
            raise AssertRefused(f"cannot grade {src!r}: isclose(x, y, rel_tol=.., abs_tol=..) only")
        try:
            tols = {k: _expected(v) for k, v in kw.items()}
            try:
                probe, want = _inside(node.args[0], src), _expected(node.args[1])
            except _NotExpected:
                probe, want = _inside(node.args[1], src), _expected(node.args[0])
        except _NotExpected:
            why = "isclose needs a literal expected value and tolerances"
            raise AssertRefused(f"cannot grade {src!r}: {why}") from None
        if not all(type(x) in (int, float) for x in (want, *tols.values())):
            raise AssertRefused(f"cannot grade {src!r}: isclose on non-numbers")
        tol = ("isclose", tols.get("rel_tol", 1e-9), tols.get("abs_tol", 0.0))
        return [Clause(probe, "close", want, tol)]
    return [Clause(_inside(node, src), "truthy")]


def _is_isclose(func) -> bool:
    import ast

    if isinstance(func, ast.Name):
        return func.id == "isclose"
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "isclose"
        and isinstance(func.value, ast.Name)
        and func.value.id in ("math", "cmath", "pytest")
    )


def split_assert(src: str) -> tuple[Clause, ...]:
    """``assert CALL == EXPECTED`` (either side; ``and`` of several; ``assert CALL``; ``assert not
    CALL``; ``CALL is None/True/False``; ``CALL in LITERAL``; ``math.isclose(CALL, EXPECTED, ...)``;
    ``abs(CALL - EXPECTED) < TOL``) as clauses whose probes run inside and whose expected values
    stay here. Anything else raises :class:`AssertRefused` (one line naming the assert)."""
    import ast

    try:
        tree = ast.parse(str(src).strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise AssertRefused(f"cannot grade {src!r}: does not parse ({type(e).__name__})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise AssertRefused(f"cannot grade {src!r}: not one assert statement")
    return tuple(_clauses(tree.body[0].test, str(src).strip()))


def split_tests(tests) -> list[tuple[Clause, ...]]:
    """Every assert of a row split (:func:`split_assert`); raises :class:`AssertRefused` on the
    first one that cannot be."""
    return [_split_cached(str(t)) for t in tests]


_SPLIT_CACHE: dict = {}


def _split_cached(src: str) -> tuple[Clause, ...]:
    if src not in _SPLIT_CACHE:
        if len(_SPLIT_CACHE) > 100_000:
            _SPLIT_CACHE.clear()
        _SPLIT_CACHE[src] = split_assert(src)
    return _SPLIT_CACHE[src]


def decode_result(line: str):
    """One result record from the sandbox, decoded with a strict whitelist: JSON of exact types,
    no NaN/Infinity, bounded ints, strings, depth and size; tags ``t`` (tuple), ``s`` (set),
    ``f`` (frozenset), ``d`` (dict as pairs), ``b`` (bytes hex). Raises ValueError otherwise."""
    import json
    import math

    def bad_constant(name):
        raise ValueError(f"{name} is not plain data")

    def parse_int(s):
        if len(s.lstrip("-")) > MAX_INT_DIGITS:
            raise ValueError("int too long")
        return int(s)

    def parse_float(s):
        if len(s) > 400:
            raise ValueError("float too long")
        f = float(s)
        if not math.isfinite(f):
            raise ValueError("float not finite")
        return f

    try:
        return json.loads(
            line, parse_constant=bad_constant, parse_int=parse_int, parse_float=parse_float
        )
    except RecursionError:
        raise ValueError("too deep") from None


def plain_value(tree, depth: int = 0, _count: list | None = None):
    """The value a decoded result record's ``v`` stands for (see :func:`decode_result`)."""
    count = _count if _count is not None else [0]
    count[0] += 1
    if depth > MAX_DEPTH or count[0] > MAX_NODES:
        raise ValueError("too deep or too big")
    t = type(tree)
    if tree is None or t in (bool, int, float):
        return tree
    if t is str:
        if len(tree) > MAX_STR:
            raise ValueError("str too long")
        return tree
    if t is list:
        return [plain_value(x, depth + 1, count) for x in tree]
    if t is dict and len(tree) == 1:
        ((tag, body),) = tree.items()
        if tag == "b" and type(body) is str and len(body) <= 2 * MAX_STR:
            return bytes.fromhex(body)
        if type(body) is list:
            items = [plain_value(x, depth + 1, count) for x in body]
            if tag == "t":
                return tuple(items)
            if tag in ("s", "f"):
                return (set if tag == "s" else frozenset)(items)  # unhashable -> TypeError
            if tag == "d" and all(type(p) is list and len(p) == 2 for p in body):
                out = {}
                for k, v in items:
                    out[k] = v  # an unhashable key -> TypeError
                return out
    raise ValueError("not plain data")


def holds(clause: Clause, value) -> bool:
    """The verdict on one decoded (plain) value: computed here, never in the sandbox."""
    import math

    kind, want = clause.kind, clause.expected
    try:
        if kind == "eq":
            return bool(value == want)
        if kind == "is":
            return value is want if want is None else (type(value) is bool and value == want)
        if kind == "truthy":
            return bool(value)
        if kind == "falsy":
            return not value
        if kind == "in":
            return bool(value in want)
        if kind == "close":
            if type(value) not in (int, float):
                return False
            if clause.tol[0] == "isclose":
                return math.isclose(value, want, rel_tol=clause.tol[1], abs_tol=clause.tol[2])
            diff = abs(value - want)
            return diff < clause.tol[1] if clause.tol[0] == "lt" else diff <= clause.tol[1]
    except (TypeError, ValueError, OverflowError):
        return False
    return False


def _harness(code: str, probes: list[str]) -> str:
    """The program the sandbox runs: the completion, then each probe (the call side of a split
    assert, never its expected value), each result encoded as plain data (exact types, bounded) on a
    descriptor the completion's own output does not reach. What it prints there is only a claim: the
    parent decodes it strictly and compares it with expected values that never entered the sandbox.
    An audit hook refuses, and marks as hostile (reward 0), what a solution never needs: the
    network, new programs, signals to anything but its own children, writes outside the work dir."""
    return f"""import sys, os, json
_STRICT = False
{_GUARD_MARK}
def _install(_flag, _strict=_STRICT):
    _work = os.path.realpath(os.getcwd())
    _ppid, _rp, _fs = os.getppid(), os.path.realpath, os.fsdecode
    _paths = ("os.remove", "os.rmdir", "shutil.rmtree", "os.rename", "os.replace", "os.chmod", "os.chown",
              "os.truncate", "os.link", "os.symlink", "os.utime", "os.mkdir", "os.chflags", "os.setxattr")
    _spawn = ("subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile", "pty.")
    _strict_deny = ("ctypes.", "os.fork", "os.forkpty")
    _busy = []

    def _inside(p):
        if isinstance(p, int):
            return True
        r = _rp(_fs(p))
        return r == _work or r.startswith(_work + "/") or r == "/dev/null"

    def _hostile(event, args):
        if event.startswith("socket.") or event.startswith(_spawn) or event == "os.killpg":
            return True
        if event == "os.kill":
            return args[0] <= 1 or args[0] == _ppid
        if event in _paths:
            return any(not _inside(a) for a in args if isinstance(a, (str, bytes, os.PathLike)))
        if event == "open":
            path, mode, flags = args
            w = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            return w and not isinstance(path, int) and not _inside(path)
        return _strict and event.startswith(_strict_deny)

    def _hook(event, args):
        if _busy:
            return
        _busy.append(1)
        try:
            bad = _hostile(event, args)
        except Exception:
            bad = False
        finally:
            _busy.clear()
        if bad:
            _flag.append(event)
            raise PermissionError("sandbox: " + event + " refused")
    sys.addaudithook(_hook)

def _enc(v, _d, _n, _t=type, _len=len, _inf=float("inf")):
    _n[0] += 1
    if _d > {MAX_DEPTH} or _n[0] > {MAX_NODES}:
        raise ValueError("too deep or too big")
    t = _t(v)
    if v is None or t is bool:
        return v
    if t is int:
        if v.bit_length() > {MAX_INT_BITS}:
            raise ValueError("int too big")
        return v
    if t is float:
        if v != v or v == _inf or v == -_inf:
            raise ValueError("not finite")
        return v
    if t is str:
        if _len(v) > {MAX_STR}:
            raise ValueError("str too long")
        return v
    if t is bytes:
        if _len(v) > {MAX_STR}:
            raise ValueError("bytes too long")
        return {{"b": v.hex()}}
    if t is list:
        return [_enc(x, _d + 1, _n) for x in v]
    if t is tuple:
        return {{"t": [_enc(x, _d + 1, _n) for x in v]}}
    if t is set or t is frozenset:
        return {{"s" if t is set else "f": [_enc(x, _d + 1, _n) for x in v]}}
    if t is dict:
        return {{"d": [[_enc(k, _d + 1, _n), _enc(x, _d + 1, _n)] for k, x in v.items()]}}
    raise TypeError("not plain data")

def _main(_W=os.write, _exit=os._exit, _dumps=json.dumps, _compile=compile, _eval=eval, _exec=exec,
          _BE=BaseException, _enc=_enc):
    _fd = os.dup(1)
    _null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(_null, 1)
    _flag = []
    _install(_flag)
    _g = {{"__name__": "__main__", "__builtins__": __builtins__}}
    _probes = {probes!r}
    try:
        _exec(_compile({code!r}, "<completion>", "exec"), _g)
        _loaded = True
    except _BE:
        _loaded = False
    _out = []
    for _i, _p in enumerate(_probes):
        _rec = {{"i": _i, "ok": False}}
        if _loaded:
            try:
                _rec = {{"i": _i, "ok": True, "v": _enc(_eval(_compile(_p, "<probe>", "eval"), _g), 0, [0])}}
            except _BE:
                _rec = {{"i": _i, "ok": False}}
        _out.append(_dumps(_rec))
    _out.append(_dumps({{"end": len(_probes), "flag": (_flag or ["-"])[0]}}))
    _b = ("\\n".join(_out) + "\\n").encode()
    while _b:
        _b = _b[_W(_fd, _b):]
    _exit(0)
_main()
"""  # noqa: E501


_GUARD_MARK = "# <guard>"
# Without a network namespace the harness is stricter (no seccomp: a weaker guard, reported as
# such).
_GUARD = "_STRICT = True"


def _world_reachable(path: str) -> bool:
    """Whether any uid may execute ``path`` (every directory above it o+x, the file o+rx)."""
    import stat

    path = os.path.realpath(path)
    try:
        parts = path.split("/")
        for i in range(2, len(parts)):
            if not os.stat("/".join(parts[:i]) or "/").st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


def sandbox_python(root: bool | None = None) -> str | None:
    """An interpreter the unprivileged sandbox uid can run (this one, else the system's);
    None when there is none (as root, the sandbox then refuses to run rather than run as root)."""
    root = os.geteuid() == 0 if root is None else root
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and os.path.exists(cand) and (not root or _world_reachable(cand)):
            return os.path.realpath(cand)
    return None


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _try(libc, fn: str, *args) -> bool:
    return getattr(libc, fn)(*args) == 0


# -------------------------------------------------------------- the launcher (a process of its own)


def _launch(cfg: dict) -> dict:
    """Runs in a fresh single-threaded process: isolate, fork the harness, wait, clean up,
    report."""
    import resource

    work, limits = cfg["work"], cfg["limits"]
    iso = {
        "uid": None,
        "userns": False,
        "netns": False,
        "pidns": False,
        "mountns": False,
        "ipcns": False,
        "utsns": False,
        "cgroupns": False,
        "keyrings": "shared",
        "cgroup": "none",
        "network": "none",
    }
    root = os.geteuid() == 0
    tmp_private = False  # a fresh tmpfs on /tmp: where the private root is built
    libc = _libc() if sys.platform.startswith("linux") else None
    uid = UID_BASE + os.getpid() if root else os.getuid()
    if cfg["python"] is None:
        raise RuntimeError(
            "no Python interpreter the sandbox uid can execute (tried this one and "
            "/usr/bin/python3)"
        )
    if root:
        iso["uid"] = uid
        os.chown(work, uid, uid)
        _kill_uid(
            uid
        )  # a leftover of an earlier sandbox with the same uid (cannot happen; belt and braces)
    if libc is not None and root and cfg.get("namespaces", True):
        iso["netns"] = _try(libc, "unshare", CLONE_NEWNET)
        iso["pidns"] = _try(libc, "unshare", CLONE_NEWPID)
        # System V IPC and POSIX message queues of its own (a channel between completions, and
        # segments that outlive them, otherwise); a host name of its own
        iso["ipcns"] = _try(libc, "unshare", CLONE_NEWIPC)
        iso["utsns"] = _try(libc, "unshare", CLONE_NEWUTS)
        if _try(libc, "unshare", CLONE_NEWNS) and _try(
            libc, "mount", None, b"/", None, MS_REC | MS_PRIVATE, None
        ):
            iso["mountns"] = True
            for d in ("/tmp", "/var/tmp", "/dev/shm"):
                if os.path.isdir(d):
                    opts = f"size={limits['file_mb'] * 2}m,mode=1777".encode()
                    ok = _try(
                        libc, "mount", b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts
                    )
                    tmp_private = tmp_private or (ok and d == "/tmp")
    elif libc is not None and cfg.get("namespaces", True):
        # not root: an unprivileged user namespace still gives no network, a pid namespace and a
        # mount namespace for a root of its own; the trainer's uid maps to itself, so the harness
        # (not uid 0 in the namespace) loses every capability at exec and cannot leave that root
        own = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        if _try(libc, "unshare", own | CLONE_NEWNS):
            iso["userns"] = iso["netns"] = iso["pidns"] = iso["ipcns"] = iso["utsns"] = True
            gid = os.getgid()
            try:
                maps = (
                    ("uid_map", f"{uid} {uid} 1"),
                    ("setgroups", "deny"),
                    ("gid_map", f"{gid} {gid} 1"),
                )
                for name, text in maps:
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
                if _try(libc, "mount", None, b"/", None, MS_REC | MS_PRIVATE, None) and _try(
                    libc,
                    "mount",
                    b"tmpfs",
                    b"/tmp",
                    b"tmpfs",
                    MS_NOSUID | MS_NODEV,
                    f"size={limits['file_mb'] * 2}m,mode=1777".encode(),
                ):
                    iso["mountns"] = tmp_private = True
            except OSError:
                pass
        elif _try(libc, "unshare", own):
            iso["userns"] = iso["netns"] = iso["pidns"] = iso["ipcns"] = iso["utsns"] = True
    weak = weak_isolation(iso)
    if weak and cfg.get("namespaces", True) and not limits.get("allow_weak_isolation"):
        # the kernel refused what the verdict relies on: the audit hook alone lives in the
        # completion's interpreter, so nothing is run
        return {"refused": weak, "isolation": iso}
    cg = _Cgroup.create(limits) if root else None
    iso["cgroup"] = cg.kind if cg else "none"
    nproc = int(limits["max_procs"]) if root else _tasks_of(uid) + int(limits["max_procs"])
    view, inside = None, work
    if iso["mountns"] and tmp_private:
        try:
            view, inside = _private_root(libc, work, cfg["python"])
        except OSError:
            view, inside = None, work
    iso["fs"] = "private" if view else "host"
    if view:
        work = view + inside
    os.makedirs(work, mode=0o700, exist_ok=True)  # under the fresh tmpfs /tmp when mountns
    if root:
        os.chown(work, uid, uid)
    iso["network"] = "netns" if iso["netns"] else "audit-hook"
    harness = cfg["program"]
    if not iso["netns"]:
        harness = harness.replace(_GUARD_MARK, _GUARD)
    prog = os.path.join(work, "main.py")
    with open(prog, "w") as f:
        f.write(harness)
    if root:
        os.chown(prog, uid, uid)
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    sync_r, sync_w = os.pipe()  # the harness -> here: which namespaces it took (one byte)
    ack_r, ack_w = os.pipe()  # here -> the harness: its user namespace's uid map is written
    calls = SYSCALLS.get(os.uname().machine, {})
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the harness: pid 1 of its namespace when pidns
        try:
            os.close(out_r)
            os.close(in_w)
            os.close(sync_r)
            os.close(ack_w)
            if cg is not None:  # the whole completion in its cgroup, before anything of it runs
                cg.join()
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.setsid()
            if iso["pidns"] and iso["mountns"] and _try(libc, "unshare", CLONE_NEWNS):
                # its own /proc (sees only its namespace), in a mount namespace of its own so that
                # the launcher's /proc stays the host's
                _try(
                    libc,
                    "mount",
                    b"proc",
                    f"{view or ''}/proc".encode(),
                    b"proc",
                    MS_NOSUID | MS_NODEV | MS_NOEXEC,
                    None,
                )
            pivoted = False
            if view:
                # pivot_root rather than chroot where it can: a chrooted process may not create
                # the user namespace below
                pivoted = root and "pivot_root" in calls and _pivot(libc, view, calls)
                if not pivoted:
                    os.chroot(view)
            os.chdir(inside)
            took = 0
            if root and (pivoted or not view) and libc is not None:
                # a user namespace of its own (uid maps to itself: no capability after exec): the
                # keyrings its uid creates are registered there and die with it, not on the host
                os.setgroups([])
                flags = CLONE_NEWUSER | (CLONE_NEWCGROUP if cg is not None else 0)
                if _try(libc, "unshare", flags):
                    took = 1 | (2 if cg is not None else 0)
            elif cg is not None and _try(libc, "unshare", CLONE_NEWCGROUP):
                took = 2
            os.write(sync_w, bytes([took]))
            if took & 1 and os.read(ack_r, 1) != b"1":
                os._exit(127)
            cpu = int(limits["cpu_s"])
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            mem = int(limits["memory_mb"]) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            fsize = int(limits["file_mb"]) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            if root:
                if not took & 1:
                    os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            if libc is not None and "keyctl" in calls:
                # a fresh session keyring (else the trainer's, which every completion possesses:
                # a channel between them, and keys left in the trainer's keyring)
                libc.syscall(calls["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None)
            # counted per uid: as root the uid is the sandbox's own, so the count is the sandbox's;
            # else the trainer's tasks are counted too, and the sandbox gets max_procs on top of
            # them
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            if libc is not None:
                libc.prctl(
                    PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0
                )  # the launcher dies -> so does the harness
            os.umask(0o077)
            env = {
                "HOME": inside,
                "TMPDIR": inside,
                "PATH": "/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONHASHSEED": "0",
            }
            os.execve(
                cfg["python"],
                [cfg["python"], "-I", "-S", "-B", os.path.join(inside, "main.py")],
                env,
            )
        finally:
            os._exit(127)
    os.close(out_w)
    os.close(in_r)
    os.close(in_w)
    for fd in cg.fds if cg is not None else ():
        os.close(fd)
    os.close(sync_w)
    os.close(ack_r)
    deadline = t0 + float(limits["wall_s"])
    took = _read_byte(sync_r, deadline)
    if took & 1:
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(f"{uid} {uid} 1")
            os.write(ack_w, b"1")
        except OSError:
            _kill(pid)
    os.close(sync_r)
    os.close(ack_w)
    iso["cgroupns"] = bool(took & 2)
    iso["keyrings"] = "private" if (took & 1 or iso["userns"]) else "shared"
    out, timed_out = _read_until(out_r, pid, deadline, cg)
    os.close(out_r)
    status_code = _reap(pid, deadline)
    if status_code is None:  # still running past the wall clock
        timed_out = True
        _kill(pid)
        status_code = _reap(pid, time.monotonic() + 5.0)
    if not iso[
        "pidns"
    ]:  # what is left of its session: children that outlived the harness (a member keeps the id)
        _kill(pid, group_only=True)
    if root:
        _kill_uid(uid)
    usage = cg.finish() if cg is not None else {}
    return {
        "out": out.decode("utf-8", "replace"),
        "timed_out": timed_out,
        "wait_status": status_code,
        "wall_s": round(time.monotonic() - t0, 3),
        "isolation": iso,
        "usage": usage,
    }


def weak_isolation(iso: dict) -> str:
    """What the kernel refused of what the verdict relies on ("" when nothing): without these,
    only the audit hook inside the completion's own interpreter guards the network, the host's
    files and the other completions."""
    missing = [k for k in ("netns", "pidns", "mountns", "ipcns") if not iso.get(k)]
    return ", ".join(missing)


def _read_byte(fd: int, deadline: float) -> int:
    import select

    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    b = os.read(fd, 1) if ready else b""
    return b[0] if b else 0


def _pivot(libc, view: str, calls: dict) -> bool:
    """Make ``view`` the root of this (own) mount namespace, the old root detached."""
    if not _try(libc, "mount", view.encode(), view.encode(), None, MS_BIND | MS_REC, None):
        return False
    os.chdir(view)
    if libc.syscall(calls["pivot_root"], b".", b".") != 0:
        return False
    if not _try(libc, "umount2", b".", MNT_DETACH):
        os._exit(127)  # the host's root would still be on top: never run the completion so
    os.chdir("/")
    return True


_LIVE: list = []  # this launcher's cgroups not yet removed


class _Cgroup:
    """One completion's cgroup: memory, processes and CPU of all its processes together, set and
    measured from outside it. cgroup v1 (memory, pids, cpu, cpuacct hierarchies) or v2; made by
    the launcher under its own cgroup before the harness starts, removed after it ends."""

    def __init__(self, kind: str, dirs: dict, limits: dict):
        self.kind, self.dirs, self.cpu_ns_max = kind, dirs, int(limits["cpu_s"]) * 10**9
        self.fds: list[int] = []
        self.cpu_over = False

    @staticmethod
    def _own(controller: str) -> str | None:
        for line in open("/proc/self/cgroup").read().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                return path
        return None

    @classmethod
    def create(cls, limits: dict) -> _Cgroup | None:
        name = f"ptops-sandbox-{os.getpid()}"
        mem = int(limits["memory_mb"]) * 1024 * 1024
        procs = str(int(limits["max_procs"]))
        dirs: dict = {}
        try:
            if os.path.isfile("/sys/fs/cgroup/memory/memory.limit_in_bytes"):
                for ctrl in ("memory", "pids", "cpu", "cpuacct"):
                    own = cls._own(ctrl)
                    if own is None or not os.path.isdir(f"/sys/fs/cgroup/{ctrl}"):
                        raise OSError(f"no {ctrl} hierarchy")
                    d = os.path.realpath(f"/sys/fs/cgroup/{ctrl}{own.rstrip('/')}/{name}")
                    if d not in dirs.values():
                        os.mkdir(d)
                    dirs[ctrl] = d
                cg = cls("v1", dirs, limits)
                cg._write("memory", "memory.limit_in_bytes", str(mem))
                try:  # no swap beyond the limit (where swap is accounted)
                    cg._write("memory", "memory.memsw.limit_in_bytes", str(mem))
                except OSError:
                    pass
                cg._write("pids", "pids.max", procs)
                period = cg._read("cpu", "cpu.cfs_period_us").strip()
                cg._write("cpu", "cpu.cfs_quota_us", period)  # one core for all its processes
            elif os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
                own = cls._own("") or "/"
                d = f"/sys/fs/cgroup{own.rstrip('/')}/{name}"
                os.mkdir(d)
                dirs = {c: d for c in ("memory", "pids", "cpu")}
                cg = cls("v2", dirs, limits)
                cg._write("memory", "memory.max", str(mem))
                cg._write("memory", "memory.swap.max", "0")
                cg._write("pids", "pids.max", procs)
                cg._write("cpu", "cpu.max", "100000 100000")
            else:
                return None
            cg.fds = [
                os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY) for d in set(dirs.values())
            ]
            _LIVE.append(cg)  # removed by the launcher's last word if it fails half-way
            return cg
        except (OSError, ValueError):
            for d in set(dirs.values()):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            return None

    def _write(self, ctrl: str, name: str, value: str) -> None:
        with open(os.path.join(self.dirs[ctrl], name), "w") as f:
            f.write(value)

    def _read(self, ctrl: str, name: str) -> str:
        with open(os.path.join(self.dirs[ctrl], name)) as f:
            return f.read()

    def _field(self, ctrl: str, name: str, key: str) -> int:
        try:
            for line in self._read(ctrl, name).splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def join(self) -> None:
        """In the harness, before it runs anything of the completion: "0" is the writer."""
        for fd in self.fds:
            os.write(fd, b"0")
            os.close(fd)

    def cpu_ns(self) -> int:
        try:
            if self.kind == "v1":
                return int(self._read("cpuacct", "cpuacct.usage"))
            return self._field("cpu", "cpu.stat", "usage_usec") * 1000
        except (OSError, ValueError):
            return 0

    def check_cpu(self) -> bool:
        """Whether all its processes together used more than ``cpu_s`` of CPU."""
        self.cpu_over = self.cpu_over or self.cpu_ns() > self.cpu_ns_max
        return self.cpu_over

    def finish(self) -> dict:
        """Kill what is left in it, measure, remove it."""
        if self in _LIVE:
            _LIVE.remove(self)
        dirs = sorted(set(self.dirs.values()))
        for _ in range(100):
            left = set()
            for d in dirs:
                try:
                    left |= {int(x) for x in open(os.path.join(d, "cgroup.procs")).read().split()}
                except OSError:
                    pass
            if not left:
                break
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)
        v1 = self.kind == "v1"
        try:
            peak = int(self._read("memory", "memory.max_usage_in_bytes" if v1 else "memory.peak"))
        except (OSError, ValueError):
            peak = -1
        usage = {
            "cgroup": self.kind,
            "memory_peak": peak,
            "memory_limit": int(
                self._read("memory", "memory.limit_in_bytes" if v1 else "memory.max")
            ),
            "oom_kills": self._field(
                "memory", "memory.oom_control" if v1 else "memory.events", "oom_kill"
            ),
            "pids_refused": self._field("pids", "pids.events", "max"),
            "cpu_ns": self.cpu_ns(),
            "cpu_over": self.check_cpu(),
        }
        for d in dirs:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
        return usage


def _private_root(libc, work: str, python: str) -> tuple[str, str]:
    """A root of the harness's own, on the fresh tmpfs /tmp: read-only, nosuid binds of what the
    interpreter needs (``/usr`` and its links, the interpreter's prefix, ``ld.so.cache``), the
    null/zero/urandom devices, an empty ``/proc`` and ``/tmp`` with the work dir. None of the
    trainer's files (the repository, caches, data sets with their expected values, run directories)
    is in it. Returns (root, work dir inside it); OSError when a mount fails (the caller keeps the
    host's view)."""
    view = "/tmp/.ptops-root"
    os.makedirs(view, mode=0o755)

    def bind(src: str, dev: bool = False) -> None:
        dst = view + src
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        if not _try(libc, "mount", src.encode(), dst.encode(), None, MS_BIND | MS_REC, None):
            raise OSError(f"bind {src}")
        if dev:  # the device's own mount flags
            return
        # read-only, nosuid, nodev on top of the source's flags (a user namespace may not drop them)
        have = os.statvfs(src).f_flag
        keep = have & (
            MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | ST_NOATIME | ST_NODIRATIME
        ) | (MS_RELATIME if have & ST_RELATIME else 0)
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep
        if not _try(libc, "mount", None, dst.encode(), None, flags, None):
            raise OSError(f"read-only {src}")

    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            os.symlink(os.readlink(top), view + top)
        elif os.path.isdir(top):
            bind(top)
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if prefix in ("", "/"):
        raise OSError(f"interpreter prefix {prefix!r}")
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        bind(prefix)
    if os.path.exists("/etc/ld.so.cache"):
        bind("/etc/ld.so.cache")
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
        if os.path.exists(dev):
            bind(dev, dev=True)
    os.makedirs(view + "/proc")
    os.makedirs(view + "/tmp")
    os.chmod(view + "/tmp", 0o1777)
    return view, "/tmp/" + os.path.basename(work)


def _read_until(fd: int, pid: int, deadline: float, cg=None) -> tuple[bytes, bool]:
    """The harness's stdout until EOF (every writer gone) or the deadline; capped. With a
    cgroup, the whole completion is killed once all its processes together used ``cpu_s``."""
    import select

    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            _kill(pid)
            return buf, True
        if cg is not None and cg.check_cpu():
            _kill(pid)
            return buf, False
        ready, _, _ = select.select([fd], [], [], min(left, 0.1 if cg is not None else 0.5))
        if not ready:
            # the harness gone but a grandchild holds the pipe (no pid namespace): stop reading
            try:
                gone = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            except ChildProcessError:
                gone = True
            if gone:
                return buf, False
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return buf, False
        if len(buf) < OUTPUT_CAP:
            buf += chunk[: OUTPUT_CAP - len(buf)]


def _reap(pid: int, deadline: float) -> int | None:
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if done == pid:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _kill(pid: int, group_only: bool = False) -> None:
    for target in (
        (-pid,) if group_only else (-pid, pid)
    ):  # its group, then itself (pid 1 of its namespace: all of it)
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: a child that becomes ``uid`` and sends ``kill(-1)``
    (reaches all of that uid's processes at once, so a fork bomb cannot outrun it), repeated
    until /proc shows none."""
    for _ in range(20):
        if not _pids_of(uid):
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.01)


def _tasks_of(uid: int) -> int:
    """Threads of ``uid`` (RLIMIT_NPROC counts threads)."""
    n = 0
    for pid in _pids_of(uid):
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _pids_of(uid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
            except OSError:
                pass
    return out


# ---------------------------------------------------------------- the caller's side


def run_code(
    code: str, tests: list[str], limits: Limits = Limits(), namespaces: bool = True
) -> Result:
    """Run ``code`` in a sandbox, then the call side of each of ``tests`` (assert statements, split
    by :func:`split_assert`); the results are decoded and judged here. Never raises for what the
    code does; raises :class:`AssertRefused` for an assert it cannot split (check the data when it
    loads).

    ``namespaces=False`` takes the fallback path (as where unshare is not permitted): tests use
    it."""
    if not tests:
        return Result(status="no_tests")
    checks = split_tests(tests)
    probes = [c.probe for clauses in checks for c in clauses]
    # under /tmp: a directory the sandbox uid can reach (a private TMPDIR may not be)
    work = tempfile.mkdtemp(prefix="ptops-sandbox-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.chmod(work, 0o700)
    cfg = {
        "work": work,
        "limits": asdict(limits),
        "program": _harness(code, probes),
        "python": sandbox_python(),
        "namespaces": namespaces,
    }
    try:
        proc = subprocess.run(
            [
                os.path.realpath(sys.executable),
                "-I",
                "-S",
                "-B",
                os.path.abspath(__file__),
                "--launch",
            ],
            input=json.dumps(cfg),
            capture_output=True,
            text=True,
            timeout=float(limits.wall_s) + 30.0,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        report = (
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0 and proc.stdout.strip()
            else None
        )
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        report, proc = None, e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if report is None:
        err = getattr(proc, "stderr", "") or str(proc)
        return Result(status="launcher_failed", detail=str(err)[-500:])
    return _score(report, checks)


def _records(out: str, n: int) -> tuple[list | None, str]:
    """The n result records and the end record's flag, or (None, why): any line out of place
    (missing, extra, out of order, not strict plain data) voids the whole run."""
    lines = out.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != n + 1:
        return None, f"{len(lines)} result lines for {n} probes"
    values = []
    try:
        for i, line in enumerate(lines[:n]):
            rec = decode_result(line)
            if (
                type(rec) is not dict
                or type(rec.get("i")) is not int
                or rec["i"] != i
                or rec.get("ok") not in (True, False)
            ):
                return None, f"record {i} malformed"
            if rec["ok"]:
                if set(rec) != {"i", "ok", "v"}:
                    return None, f"record {i} malformed"
                values.append((True, plain_value(rec["v"])))
            else:
                if set(rec) != {"i", "ok"}:
                    return None, f"record {i} malformed"
                values.append((False, None))
        end = decode_result(lines[n])
    except (ValueError, TypeError) as e:
        return None, f"undecodable record: {str(e)[:80]}"
    if (
        type(end) is not dict
        or set(end) != {"end", "flag"}
        or end["end"] != n
        or type(end["flag"]) is not str
    ):
        return None, "end record malformed"
    return values + [end["flag"]], ""


def _score(report: dict, checks: list[tuple[Clause, ...]]) -> Result:
    total = len(checks)
    if report.get("refused"):
        return Result(
            total=total,
            status="refused",
            isolation=report["isolation"],
            detail=f"the kernel refused {report['refused']}: not graded "
            "([trl.sandbox] allow_weak_isolation = true grades with the audit hook alone)",
        )
    res = Result(total=total, isolation=report["isolation"], wall_s=report["wall_s"])
    res.usage = report.get("usage", {})
    status = report["wait_status"]
    n = sum(len(c) for c in checks)
    if report["timed_out"]:
        res.status = "timeout"
        return res
    if res.usage.get("oom_kills") or res.usage.get("cpu_over"):
        # a limit of the whole completion (its cgroup), whatever the harness then printed
        res.status = "killed"
        res.detail = (
            f"limit of the whole completion: oom kills {res.usage.get('oom_kills')}, "
            f"cpu over {res.usage.get('cpu_over')}"
        )
        return res
    if status is None or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        res.status = "killed" if status is not None and os.WIFSIGNALED(status) else "error"
        res.detail = f"wait status {status}"
        return res
    if not report["out"].endswith("\n") or '"end"' not in report["out"].rsplit("\n", 2)[-2]:
        res.status = "no_result"  # it never reached its end (an early exit, a crash of the harness)
        return res
    recs, why = _records(report["out"], n)
    if recs is None:
        res.status, res.detail = "malformed", why
        return res
    flag = recs.pop()
    if flag != "-":
        res.status, res.detail = "hostile", flag
        return res
    it = iter(recs)
    for clauses in checks:
        verdicts = [ok and holds(c, v) for c, (ok, v) in zip(clauses, it)]
        res.passed += all(verdicts)
    res.reward = res.passed / total
    return res


def isolation_available(limits: Limits = Limits()) -> dict:
    """What a sandbox here would get (for the reward_source event): one harmless run. Says so
    at start, in one line, where the kernel refuses the isolation or a cgroup."""
    res = run_code("x = 1", ["assert x == 1"], limits)
    iso = dict(res.isolation)
    weak = weak_isolation(iso)
    if weak:
        how = (
            "grading with the audit hook alone (allow_weak_isolation = true)"
            if limits.allow_weak_isolation
            else "refusing to grade untrusted code; [trl.sandbox] allow_weak_isolation = true "
            "opts in to the audit hook alone"
        )
        print(f"sandbox: the kernel refused {weak}: {how}", file=sys.stderr)
    elif iso.get("cgroup", "none") == "none":
        print(
            "sandbox: no writable cgroup: limits are per process (rlimits): memory up to "
            "memory_mb x max_procs, CPU up to cpu_s per process",
            file=sys.stderr,
        )
    iso["refused"] = res.status == "refused"
    return iso


if __name__ == "__main__" and sys.argv[1:] == ["--launch"]:
    _cfg = json.loads(sys.stdin.read())
    try:
        _out = _launch(_cfg)
    except Exception as _e:  # noqa: BLE001 - one line to the caller, who scores it 0
        for _cg in list(_LIVE):  # what it made on the host goes, its processes killed first
            _cg.finish()
        print(f"sandbox launcher failed: {type(_e).__name__}: {_e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(_out))
