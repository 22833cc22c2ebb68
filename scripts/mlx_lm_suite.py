"""Run mlx-lm's own unittest suite and record every test's outcome, or compare two such records.

    python mlx_lm_suite.py run TESTS_DIR OUT.json [PATTERN ...]   # in the venv under test
    python mlx_lm_suite.py run --fused-attention TESTS_DIR OUT.json [PATTERN ...]
    python mlx_lm_suite.py compare STOCK.json PATCHED.json        # the side-by-side table
    python mlx_lm_suite.py check RUN.json                         # exit 1 on a failure with no reason

`run` discovers TESTS_DIR the way mlx-lm's CI does (`python -m unittest discover tests`), from a
directory with no mlx_lm/ source tree beside it (so the installed wheel is what runs), optionally
only the files matching the glob PATTERNs (a PATTERN starting with ! excludes). Each test gets one outcome: pass, fail, error, skip,
expected-failure, unexpected-success, or not-run (its class or module set-up failed; the set-up's
error is kept as the reason). `--fused-attention` runs the suite with mlx-h2o's fused CPU attention
as every model's attention (`mlx_h2o.use_fast_cpu_attention()`), to compare it with mlx-lm's own.
`compare` prints, per test file, pass/fail/error/skip on stock and on
patched, the tests that pass on stock but not patched (regressions: exit status 1), the series' new
tests, and the tests that cannot run here with the reason (a model or data set from a hub, which
this offline machine cannot reach; a package the venvs do not install; MLX's Metal back-end).
"""

import fnmatch
import json
import os
import sys
import time
import traceback
import unittest
from collections import Counter, defaultdict

# An error whose traceback mentions one of these could not reach a hub (the machine is offline).
HUB_MARKERS = (
    "huggingface_hub",
    "LocalEntryNotFoundError",
    "OfflineModeIsEnabled",
    "HFValidationError",
    "RepositoryNotFoundError",
    "snapshot_download",
    "hf_hub_download",
    "ConnectionError",
    "We couldn't connect",
)


def _iter_tests(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _iter_tests(item)
        else:
            yield item


class _Recorder(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self.setup_errors = []  # (description, traceback) of class/module set-ups that failed
        self._start = {}

    def _text(self, err):
        return "".join(traceback.format_exception(*err))

    def _set(self, test, outcome, detail=""):
        if isinstance(test, unittest.case._SubTest):
            test = test.test_case
            if outcome == "pass" or self.outcomes.get(test.id(), ("pass",))[0] != "pass":
                return
        tid = _test_id(test)
        if hasattr(test, "_testMethodName"):
            self.outcomes[tid] = (outcome, detail, round(time.perf_counter() - self._start.get(tid, time.perf_counter()), 3))
        else:  # _ErrorHolder: setUpClass / setUpModule / import error
            self.setup_errors.append((str(test), detail))

    def startTest(self, test):
        self._start[_test_id(test)] = time.perf_counter()
        super().startTest(test)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._set(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set(test, "fail", self._text(err))

    def addError(self, test, err):
        super().addError(test, err)
        self._set(test, "error", self._text(err))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set(test, "expected-failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set(test, "unexpected-success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            kind = "fail" if issubclass(err[0], test.failureException) else "error"
            self.outcomes[test.id()] = (kind, self._text(err), 0.0)


def _test_id(test) -> str:
    """A module that fails to import becomes one test named MODULE.(import)."""
    tid = test.id()
    if tid.startswith("unittest.loader._FailedTest."):
        return tid.rsplit(".", 1)[-1] + ".(import)"
    return tid


def _file_of(test_id: str) -> str:
    return test_id.split(".")[0] + ".py"


def cmd_run(tests_dir, out, patterns, fused_attention=False):
    if fused_attention:
        import mlx_h2o

        mlx_h2o.use_fast_cpu_attention()
    tests_dir = os.path.abspath(tests_dir)
    os.chdir(os.path.dirname(tests_dir))
    if os.path.isdir("mlx_lm"):
        sys.exit(f"{os.getcwd()} has an mlx_lm/ source tree: the suite would not test the installed wheel")
    sys.path.insert(0, tests_dir)
    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    for name in sorted(os.listdir(tests_dir)):
        if not (name.startswith("test") and name.endswith(".py")):
            continue
        includes = [p for p in patterns if not p.startswith("!")]
        if includes and not any(fnmatch.fnmatch(name, p) for p in includes):
            continue
        if any(fnmatch.fnmatch(name, p[1:]) for p in patterns if p.startswith("!")):
            continue
        suite.addTests(loader.loadTestsFromName(name[:-3]))
    every = [_test_id(t) for t in _iter_tests(suite) if hasattr(t, "_testMethodName")]
    import mlx_lm

    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=1, stream=sys.stderr)
    # mlx-lm's model tests draw random weights without a seed; one fixed seed makes two runs (stock
    # and patched, or two attention implementations) test the same models.
    import mlx.core as mx

    mx.random.seed(0)
    tic = time.perf_counter()
    result = runner.run(suite)
    seconds = time.perf_counter() - tic
    outcomes = dict(result.outcomes)
    for tid in every:  # never ran: a class or module set-up (or the import) failed
        if tid not in outcomes:
            reasons = [tb for desc, tb in result.setup_errors if tid.rsplit(".", 1)[0] in desc or _file_of(tid)[:-3] in desc]
            outcomes[tid] = ("not-run", reasons[0] if reasons else "set-up failed", 0.0)
    record = {
        "mlx_lm": mlx_lm.__version__,
        "python": sys.version.split()[0],
        "seconds": round(seconds, 1),
        "outcomes": {k: {"outcome": o, "detail": d, "seconds": s} for k, (o, d, s) in sorted(outcomes.items())},
        "setup_errors": result.setup_errors,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"mlx-lm {mlx_lm.__version__}: {Counter(o for o, *_ in outcomes.values())} in {seconds:.0f} s -> {out}", file=sys.stderr)


def _cannot_run_reason(detail: str) -> str:
    if any(m in detail for m in HUB_MARKERS):
        return "needs a model or data set from the Hugging Face hub (offline)"
    if "metal" in detail.lower() or "_gated_delta_kernel_impl" in detail:
        return "needs MLX's Metal back-end (a Mac GPU; here MLX runs on the CPU)"
    for line in reversed(detail.strip().splitlines()):
        if "ModuleNotFoundError" in line or "ImportError" in line:
            return f"needs a package the venvs do not install ({line.split(':', 1)[-1].strip()})"
    return ""


def cmd_compare(stock_path, patched_path):
    stock = json.load(open(stock_path))
    patched = json.load(open(patched_path))
    s_out, p_out = stock["outcomes"], patched["outcomes"]
    files = sorted({_file_of(t) for t in (*s_out, *p_out)})
    kinds = ("pass", "fail", "error", "skip", "not-run")

    def counts(outcomes, f):
        c = Counter(v["outcome"] for t, v in outcomes.items() if _file_of(t) == f)
        c["pass"] += c.pop("expected-failure", 0)
        c["fail"] += c.pop("unexpected-success", 0)
        return c

    print(f"mlx-lm suite, stock {stock['mlx_lm']} ({stock['seconds']} s) vs patched {patched['mlx_lm']} ({patched['seconds']} s)\n")
    print("| test file | stock pass/fail/error/skip/not-run | patched pass/fail/error/skip/not-run |")
    print("| --- | --- | --- |")
    totals = [Counter(), Counter()]
    for f in files:
        cells = []
        for i, outcomes in enumerate((s_out, p_out)):
            c = counts(outcomes, f)
            totals[i].update(c)
            cells.append("/".join(str(c[k]) for k in kinds) if c else "—")
        print(f"| {f} | {cells[0]} | {cells[1]} |")
    print(f"| **total** | {'/'.join(str(totals[0][k]) for k in kinds)} | {'/'.join(str(totals[1][k]) for k in kinds)} |")

    regressions = [t for t, v in s_out.items() if v["outcome"] in ("pass", "expected-failure")
                   and p_out.get(t, {}).get("outcome") not in ("pass", "expected-failure")]
    new = sorted(t for t in p_out if t not in s_out)
    print(f"\nRegressions (pass on stock, not on patched): {len(regressions)}")
    for t in regressions:
        print(f"- {t}: {p_out.get(t, {}).get('outcome', 'missing')}")
    print(f"\nTests of the series (only in the patched tree): {len(new)}, "
          f"{sum(p_out[t]['outcome'] == 'pass' for t in new)} pass")
    for t in new:
        print(f"- {t}: {p_out[t]['outcome']}")

    offline = defaultdict(list)
    unexplained = []
    for t, v in sorted(s_out.items()):
        if v["outcome"] in ("error", "fail", "not-run"):
            reason = _cannot_run_reason(v["detail"])
            if reason:
                offline[reason].append(t)
            else:
                unexplained.append(t)
    print("\nTests that cannot run on this machine (stock and patched alike), by reason:")
    for reason, tests in offline.items():
        by_file = Counter(_file_of(t) for t in tests)
        print(f"- {reason}: {len(tests)} tests ({', '.join(f'{f} {n}' for f, n in sorted(by_file.items()))})")
    for reason, tests in offline.items():
        print(f"\n{reason}:")
        print("\n".join(f"- {t} ({s_out[t]['outcome']})" for t in tests))
    if unexplained:
        print(f"\nFailing on stock for another reason: {len(unexplained)}")
        for t in unexplained:
            last = s_out[t]["detail"].strip().splitlines()[-1:] or [""]
            print(f"- {t}: {s_out[t]['outcome']}: {last[0][:160]}")
    return 1 if regressions else 0


def cmd_check(path):
    """The tests of one run that failed for no known reason (CI: the patched wheel on its own)."""
    run = json.load(open(path))
    outcomes = run["outcomes"]
    bad = [t for t, v in outcomes.items() if v["outcome"] in ("fail", "error", "not-run", "unexpected-success")
           and not _cannot_run_reason(v["detail"])]
    c = Counter(v["outcome"] for v in outcomes.values())
    cannot = sum(1 for v in outcomes.values() if v["outcome"] in ("fail", "error", "not-run") and _cannot_run_reason(v["detail"]))
    for t in bad:
        print(f"FAILED {t}\n{outcomes[t]['detail']}")
    print(f"mlx-lm {run['mlx_lm']} suite: {c['pass'] + c['expected-failure']} passed, {len(bad)} failed, "
          f"{c['skip']} skipped, {cannot} cannot run here (hub / Metal / package)")
    return 1 if bad else 0


if __name__ == "__main__":
    fused = "--fused-attention" in sys.argv[2:3]
    args = [a for i, a in enumerate(sys.argv) if not (i == 2 and fused)]
    if len(args) >= 4 and args[1] == "run":
        cmd_run(args[2], args[3], args[4:], fused_attention=fused)
    elif len(args) == 4 and args[1] == "compare":
        sys.exit(cmd_compare(args[2], args[3]))
    elif len(args) == 3 and args[1] == "check":
        sys.exit(cmd_check(args[2]))
    else:
        sys.exit(__doc__)
