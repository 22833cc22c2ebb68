"""Reserved KV buffers vs mlx-lm's KVCache vs a pre-allocated maximum: memory and stalls, one run.

    PYTHONPATH=src python3 benchmarks/bench_reserved.py [--tokens 16384] [--decode-steps 4096] \
        [--plot reserved.png] [--json reserved.json]

1. Memory vs tokens, SmolLM2's KV shapes (30 layers x K/V, 3 kv heads, head_dim 64, float32):
   each cache runs in its own subprocess (so one cache's freed memory cannot flatter another) and
   gets one token's K/V per layer per step, as decoding writes them, up to --tokens. Recorded:
   RSS growth, MLX active memory, bytes resident in the cache's own buffers (mincore), bytes
   written, and the latency of each step's 30 cache updates.
   Caches: mlx-lm `KVCache` (grows in 256-token steps by copying), a pre-allocated maximum
   (`KVCache` whose first step allocates --tokens positions, zero-filled, as llama.cpp does), and
   `reserved` (mlx_h2o.make_cache(model, "reserved", max_context=--tokens)).
2. Real-model decode: SmolLM2, one token of real text at a time for --decode-steps steps after a
   32-token prefill, KVCache and reserved in lockstep (same tokens, alternating which goes first),
   so machine noise hits both alike. Per-step latency p50/p99/p99.9/max, and the steps where
   KVCache grows.
3. Storage under other caches (synthetic updates, same shapes): mlx-lm's 8-bit QuantizedKVCache
   vs the same scheme over ReservedBuffers; an H2O-like bounded cache (budget 1024 + 64 slack,
   gather-compaction to the budget whenever the slack fills) over mlx-lm KVCache storage vs a
   ReservedBuffer written in place.
0. Where MLX's CPU allocator gets a large buffer, and whether it arrives with committed pages.
4. Why the buffers are head-major: one decode step's attention over a head-major buffer vs a
   token-major one viewed head-major.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as lm_cache
from tqdm import tqdm

from mlx_h2o.storage import ReservedBuffer
from mlx_h2o.caches.reserved import ReservedKVCache
from mlx_h2o.evaluation import load_corpus, memory_snapshot, resident_bytes, token_samples
from mlx_h2o.evaluation.report import markdown_table, write_json

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M (checked against the loaded model in part 2)
MiB = 2**20


# --- caches under test (benchmark-only variants) -----------------------------------------------


def preallocated_cache(max_context):
    """KVCache whose first (and only) growth step is the whole context: allocate the maximum once."""
    return type("PreallocatedKVCache", (lm_cache.KVCache,), {"step": max_context})()


class ReservedQuantizedKVCache(lm_cache.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache scheme (packed codes, scales, biases) stored in ReservedBuffers
    instead of arrays grown by 256-token concatenations. A measurement prototype only."""

    def __init__(self, max_context, group_size=64, bits=8):
        super().__init__(group_size=group_size, bits=bits)
        self._buffers = [[ReservedBuffer(max_context) for _ in range(3)] for _ in range(2)]

    def update_and_fetch(self, keys, values):
        out = []
        for bufs, x in zip(self._buffers, (keys, values)):
            for buf, part in zip(bufs, mx.quantize(x, group_size=self.group_size, bits=self.bits)):
                buf.append(part)
            out.append(tuple(b.view() for b in bufs))
        self.offset += keys.shape[2]
        return tuple(out)

    def storage(self):
        return [b._data for bufs in self._buffers for b in bufs]


class H2OLikeStorage:
    """The storage pattern of a bounded heavy-hitter cache: append until budget + slack, then keep
    `budget` positions (a per-head gather) and continue. The compaction runs at the start of the
    next update, when the views handed to the last step's attention are dead, so reserved storage
    can take the gathered positions in place. `reserved=False` stores them in mlx-lm's KVCache
    (grows by copying; the gather result becomes a new buffer); `reserved=True` in one
    ReservedBuffer of budget + slack positions per K/V."""

    def __init__(self, budget=1024, slack=64, reserved=False, seed=0):
        self.budget, self.slack, self.reserved = budget, slack, reserved
        self.rng = np.random.default_rng(seed)
        if reserved:
            self.k, self.v = ReservedBuffer(budget + slack), ReservedBuffer(budget + slack)
        else:
            self.cache = lm_cache.KVCache()

    def _compact(self, k, v):
        # Stand-in scores: which positions survive does not change the storage work.
        B, H, N, _ = k.shape
        idx = mx.array(np.sort(self.rng.permutation(N)[: self.budget]))[None, None, :, None]
        idx = mx.broadcast_to(idx, (B, H, self.budget, 1))
        return mx.take_along_axis(k, idx, axis=2), mx.take_along_axis(v, idx, axis=2)

    def update_and_fetch(self, keys, values):
        if self.reserved:
            if self.k.length == self.budget + self.slack:
                kept_k, kept_v = self._compact(self.k.view(), self.v.view())
                self.k.write(0, kept_k)
                self.v.write(0, kept_v)
            self.k.append(keys)
            self.v.append(values)
            return self.k.view(), self.v.view()
        if self.cache.offset == self.budget + self.slack:
            kept = self._compact(*self.cache.keys_and_values())
            self.cache = lm_cache.KVCache()
            self.cache.update_and_fetch(*kept)
        return self.cache.update_and_fetch(keys, values)

    def storage(self):
        return [self.k._data, self.v._data] if self.reserved else [self.cache.keys, self.cache.values]


def make_caches(kind, max_context):
    if kind == "KVCache":
        return [lm_cache.KVCache() for _ in range(LAYERS)]
    if kind == "preallocated":
        return [preallocated_cache(max_context) for _ in range(LAYERS)]
    if kind == "reserved":
        return [ReservedKVCache(max_context) for _ in range(LAYERS)]
    if kind == "QuantizedKVCache":
        return [lm_cache.QuantizedKVCache(group_size=64, bits=8) for _ in range(LAYERS)]
    if kind == "reserved-quantized":
        return [ReservedQuantizedKVCache(max_context) for _ in range(LAYERS)]
    if kind in ("h2o-like/KVCache", "h2o-like/reserved"):
        return [H2OLikeStorage(reserved=kind.endswith("reserved"), seed=i) for i in range(LAYERS)]
    raise ValueError(f"unknown cache kind {kind!r}")


def storage_arrays(c):
    """The arrays that hold a cache's memory (whole buffers, not the live views)."""
    if isinstance(c, ReservedKVCache):
        return [c._keys._data, c._values._data]
    if isinstance(c, (ReservedQuantizedKVCache, H2OLikeStorage)):
        return c.storage()
    if isinstance(c, lm_cache.QuantizedKVCache):
        return [*c.keys, *c.values]
    return [c.keys, c.values]


# --- part 1 and 3: one cache kind in one process --------------------------------------------------


def memory_worker(kind, tokens, every):
    """Decode-shaped updates into one kind of cache; returns the memory series and step latencies."""
    mx.random.seed(0)
    pool = [(mx.random.normal((1, KV_HEADS, 1, HEAD_DIM)), mx.random.normal((1, KV_HEADS, 1, HEAD_DIM))) for _ in range(64)]
    mx.eval(pool)
    caches = make_caches(kind, tokens)
    token_bytes = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    base = memory_snapshot()
    series, step_s = [], []
    for t in range(tokens):
        k, v = pool[t % len(pool)]
        t0 = time.perf_counter()
        fetched = [c.update_and_fetch(k, v) for c in caches]
        mx.eval(fetched)  # views of the caches: evaluating them runs the writes (and any growth)
        step_s.append(time.perf_counter() - t0)
        del fetched
        if (t + 1) % every == 0 or t + 1 == tokens:
            snap = memory_snapshot()
            resident = [resident_bytes(a) for c in caches for a in storage_arrays(c)]
            series.append(
                {
                    "tokens": t + 1,
                    "written_bytes": (t + 1) * token_bytes,
                    "rss_growth_bytes": snap["rss_bytes"] - base["rss_bytes"],
                    "mlx_active_bytes": snap["mlx_active_bytes"] - base["mlx_active_bytes"],
                    "resident_bytes": None if None in resident else sum(resident),
                    "storage_bytes": sum(a.nbytes for c in caches for a in storage_arrays(c)),
                }
            )
    return {"kind": kind, "series": series, "step_ms": (np.array(step_s) * 1e3).tolist()}


def run_worker_subprocess(kind, tokens, every):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--tokens", str(tokens), "--every", str(every)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    if out.returncode != 0:
        raise RuntimeError(f"worker {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def latency_stats(ms):
    ms = np.asarray(ms)
    p50 = float(np.percentile(ms, 50))
    return {
        "p50_ms": p50,
        "p99_ms": float(np.percentile(ms, 99)),
        "p999_ms": float(np.percentile(ms, 99.9)),
        "max_ms": float(ms.max()),
        "p99_over_p50": float(np.percentile(ms, 99)) / p50,
        "max_over_p50": float(ms.max()) / p50,
    }


# --- part 2: the real model ------------------------------------------------------------------------


def real_decode(steps, prefill=32):
    model, tokenizer = mlx_h2o.load()
    args = model.args
    assert (args.num_hidden_layers, args.num_key_value_heads, args.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    tokens = token_samples(tokenizer, load_corpus(), 1, prefill + steps)[0][1]
    caches = {
        "KVCache": mlx_h2o.make_cache(model, "full"),
        "reserved": mlx_h2o.make_cache(model, "reserved", max_context=prefill + steps),
    }
    prompt = mx.array(tokens[:prefill])[None]
    for cache in caches.values():
        mx.eval(model(prompt, cache=cache))
    times = {name: [] for name in caches}
    max_diff = 0.0
    for i in tqdm(range(steps), desc="real-model decode (lockstep)", file=sys.stderr):
        x = mx.array([[tokens[prefill + i]]])
        order = list(caches) if i % 2 == 0 else list(caches)[::-1]
        logits = {}
        for name in order:
            t0 = time.perf_counter()
            logits[name] = model(x, cache=caches[name])
            mx.eval(logits[name])
            times[name].append(time.perf_counter() - t0)
        if i % 64 == 0:
            max_diff = max(max_diff, float(mx.abs(logits["KVCache"] - logits["reserved"]).max()))
    # Steps where KVCache's update crossed a 256-token boundary and grew its buffers.
    growth = [i for i in range(steps) if (prefill + i) % lm_cache.KVCache.step == 0]
    return {
        "steps": steps,
        "prefill": prefill,
        "step_ms": {name: (np.array(t) * 1e3).tolist() for name, t in times.items()},
        "growth_steps": growth,
        "max_abs_logit_diff": max_diff,
    }


# --- part 0: where MLX's CPU allocator gets a large buffer ------------------------------------------


def allocator_probe(sizes_mib=(1, 12, 48)):
    """For each size: write a buffer and free it (optionally then mx.clear_cache()), then reserve
    one of about the same size. Does the reservation land on the freed memory while its pages are
    still committed (dirty)? The reservation's own resident bytes show what `uninitialized` leaves
    committed after giving the pages back."""
    import ctypes

    from mlx_h2o import _ext
    from mlx_h2o.evaluation.memory import array_address, resident_range

    page = os.sysconf("SC_PAGE_SIZE")
    sbrk = ctypes.CDLL(None).sbrk
    sbrk.restype = ctypes.c_void_p
    rows = []
    for mib in sizes_mib:
        n = mib * MiB
        for clear in (False, True):
            # Two pages larger: `uninitialized` asks for one spare page, and MLX's cache hands out
            # a buffer for any request between its size and twice that (or two pages more).
            old_bytes = n + 2 * page
            old = mx.zeros([old_bytes], mx.uint8)
            mx.eval(old)
            old_at = array_address(old)
            del old
            if clear:
                mx.clear_cache()
            held_by_mlx = mx.get_cache_memory() >= old_bytes
            dirty = resident_range(old_at, old_bytes)  # None: unmapped, given back to the OS
            new = _ext.uninitialized([n], mx.uint8)
            new_at = array_address(new)
            lands = old_at - page <= new_at < old_at + old_bytes
            rows.append(
                {
                    "MiB": mib,
                    "freed buffer, then": "mx.clear_cache()" if clear else "nothing",
                    "held in MLX's buffer cache": held_by_mlx,
                    "its pages still committed MiB": "unmapped" if dirty is None else f"{dirty / MiB:.1f}",
                    "reservation reuses that committed memory": bool(lands and dirty),
                    "reservation from": "heap (brk)" if new_at < sbrk(0) else "mmap",
                    "reservation resident after uninitialized MiB": f"{resident_range(new_at, n) / MiB:.2f}",
                }
            )
            del new
            mx.clear_cache()
    return rows


# --- part 4: why the buffers are head-major -----------------------------------------------------------


def attention_layout(contexts, reps=20):
    """One decode step's attention (SmolLM2: 9 query heads over 3 kv heads) reading the live prefix
    of a head-major (B, H, N, D) buffer, as the reserved cache stores it, vs a token-major
    (B, N, H, D) buffer viewed as (B, H, N, D), which would commit one stream per (layer, K/V)
    instead of one per head. Returns median ms and MLX peak-memory growth per call."""
    cap = max(contexts)
    q = mx.random.normal((1, 3 * KV_HEADS, 1, HEAD_DIM))
    head_major = mx.random.normal((1, KV_HEADS, cap, HEAD_DIM))
    token_major = mx.random.normal((1, cap, KV_HEADS, HEAD_DIM))
    mx.eval(q, head_major, token_major)
    layouts = {
        "head-major (B, H, N, D)": lambda n: head_major[:, :, :n, :],
        "token-major (B, N, H, D) viewed as (B, H, N, D)": lambda n: token_major[:, :n].transpose(0, 2, 1, 3),
    }
    rows = []
    for n in contexts:
        for name, view in layouts.items():
            times = []
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            for _ in range(reps):
                kv = view(n)
                t0 = time.perf_counter()
                mx.eval(mx.fast.scaled_dot_product_attention(q, kv, kv, scale=HEAD_DIM**-0.5))
                times.append(time.perf_counter() - t0)
            rows.append({"context": n, "layout": name, "ms": float(np.median(times) * 1e3),
                         "peak_growth_bytes": mx.get_peak_memory() - base})
    return rows


# --- report ----------------------------------------------------------------------------------------


def structural_steps(kind, n_steps):
    """Step indices at which a storage does its periodic extra work: KVCache-style growth (the
    cache holds a multiple of 256 tokens and gets one more) or the H2O-like compaction. The same
    indices are used for the reserved counterpart, so the pair compares like with like."""
    if kind.startswith("h2o-like/"):
        first = H2OLikeStorage().budget + H2OLikeStorage().slack
        return [t for t in range(first, n_steps) if (t - first) % H2OLikeStorage().slack == 0]
    return [t for t in range(1, n_steps) if t % lm_cache.KVCache.step == 0]


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory, decode = results.get("memory") or [], results.get("decode")
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (rss_ax, active_ax), (update_ax, decode_ax) = axes
    for r in memory:
        s = r["series"]
        x = [p["tokens"] for p in s]
        rss_ax.plot(x, [p["rss_growth_bytes"] / MiB for p in s], label=r["kind"])
        active_ax.plot(x, [p["mlx_active_bytes"] / MiB for p in s], label=r["kind"])
        update_ax.plot(np.arange(1, len(r["step_ms"]) + 1), r["step_ms"], linewidth=0.5, label=r["kind"])
    if memory:
        s = memory[0]["series"]
        rss_ax.plot([p["tokens"] for p in s], [p["written_bytes"] / MiB for p in s], "k:", label="bytes written")
    for ax, title in ((rss_ax, "process RSS growth"), (active_ax, "MLX active memory")):
        ax.set_xlabel("tokens in the cache")
        ax.set_ylabel("MiB")
        ax.set_title(f"{title} (SmolLM2 KV shapes, fp32)")
    update_ax.set_yscale("log")
    update_ax.set_xlabel("tokens in the cache")
    update_ax.set_ylabel("ms per step (30 layers' K/V updates)")
    update_ax.set_title("cache update latency, synthetic decode")
    if decode:
        growth = decode["growth_steps"]
        for name, ms in decode["step_ms"].items():
            x = np.arange(len(ms)) + decode["prefill"] + 1
            line = decode_ax.plot(x, ms, linewidth=0.4, alpha=0.7, label=name)[0]
            decode_ax.plot(x[growth], np.asarray(ms)[growth], "o", color=line.get_color(), markersize=4)
        decode_ax.set_yscale("log")
        decode_ax.set_xlabel("context (tokens); dots: KVCache's growth steps")
        decode_ax.set_ylabel("ms per decode step")
        decode_ax.set_title("SmolLM2 decode step latency, lockstep (shared machine)")
    else:
        decode_ax.axis("off")
    for ax in (rss_ax, active_ax, update_ax, decode_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(results):
    page = os.sysconf("SC_PAGE_SIZE")
    if results.get("probe"):
        probe = results["probe"]
        print("\n## MLX's CPU allocator: does a new reservation reuse freed, still-committed memory?\n")
        print(markdown_table(list(probe[0]), [[str(v) for v in r.values()] for r in probe]))

    memory = results.get("memory") or []
    if memory:
        mrows, lrows = [], []
        for r in memory:
            end, half = r["series"][-1], r["series"][len(r["series"]) // 2 - 1]
            # Committed beyond what was written, worst sample of the run, in pages per (layer, K/V).
            over = [(p["resident_bytes"] - p["written_bytes"]) / page / (LAYERS * 2) for p in r["series"] if p["resident_bytes"] is not None]
            mrows.append(
                [r["kind"], f"{half['tokens']}", f"{half['written_bytes'] / MiB:.1f}", f"{half['rss_growth_bytes'] / MiB:.1f}",
                 f"{half['mlx_active_bytes'] / MiB:.1f}", f"{end['tokens']}", f"{end['written_bytes'] / MiB:.1f}",
                 f"{end['rss_growth_bytes'] / MiB:.1f}", f"{end['resident_bytes'] / MiB:.1f}" if end["resident_bytes"] is not None else "n/a",
                 f"{max(over):.2f}" if over else "n/a", f"{end['mlx_active_bytes'] / MiB:.1f}"]
            )
            lrows.append(latency_row(r))
        print("\n## Memory vs tokens (SmolLM2 KV shapes, one token per step, each cache in its own process)\n")
        print(
            markdown_table(
                ["cache", "tokens", "written MiB", "RSS growth MiB", "MLX active MiB", "tokens", "written MiB", "RSS growth MiB",
                 "resident in cache buffers MiB", "max (resident - written), pages per (layer, K/V)", "MLX active MiB"],
                mrows,
            )
        )
        print("\n## Update latency in those runs (all 30 layers' K/V writes of one step)\n")
        print(markdown_table(LATENCY_HEADERS, lrows))

    storage = results.get("storage") or []
    if storage:
        rows = [[*latency_row(r)[:1], f"{max(p['rss_growth_bytes'] for p in r['series']) / MiB:.1f}",
                 f"{r['series'][-1]['mlx_active_bytes'] / MiB:.1f}", *latency_row(r)[1:],
                 f"{float(np.sum(r['step_ms'])) / 1e3:.1f}"] for r in storage]
        print("\n## As storage under other caches (synthetic updates, SmolLM2 KV shapes)\n")
        print(markdown_table([LATENCY_HEADERS[0], "peak RSS growth MiB", "MLX active MiB at end", *LATENCY_HEADERS[1:], "total s"], rows))

    decode = results.get("decode")
    if decode:
        growth = decode["growth_steps"]
        ref_p50 = latency_stats(decode["step_ms"]["KVCache"])["p50_ms"]
        rows = []
        for name, ms in decode["step_ms"].items():
            st = latency_stats(ms)
            at_growth = np.median(np.asarray(ms)[growth]) if growth else float("nan")
            rows.append([name, f"{st['p50_ms']:.1f}", f"{st['p99_ms']:.1f}", f"{st['p999_ms']:.1f}", f"{st['max_ms']:.1f}",
                         f"{st['p99_over_p50']:.2f}", f"{at_growth:.1f}", f"{st['p50_ms'] / ref_p50:.3f}"])
        print(f"\n## Real-model decode: SmolLM2, {decode['steps']} steps after a {decode['prefill']}-token prefill, lockstep\n")
        print(markdown_table(["cache", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "p99/p50",
                              f"median ms at KVCache's {len(growth)} growth steps", "p50 vs KVCache"], rows))
        # Lockstep pairs share the machine's noise: the paired difference isolates the growth cost.
        diff = np.array(decode["step_ms"]["KVCache"]) - np.array(decode["step_ms"]["reserved"])
        is_growth = np.isin(np.arange(len(diff)), growth)
        if is_growth.any():
            print(f"\nKVCache minus reserved, same step: median {np.median(diff[is_growth]):+.1f} ms at KVCache's growth "
                  f"steps, {np.median(diff[~is_growth]):+.1f} ms at the others")
        print(f"max |logit difference| KVCache vs reserved (every 64th step): {decode['max_abs_logit_diff']:.3g}")

    layout = results.get("layout") or []
    if layout:
        print("\n## One decode step's attention over the live prefix, by buffer layout (MLX fast SDPA, CPU)\n")
        print(markdown_table(["context", "buffer layout", "median ms", "MLX peak growth MiB"],
                             [[r["context"], r["layout"], f"{r['ms']:.2f}", f"{r['peak_growth_bytes'] / MiB:.1f}"] for r in layout]))


LATENCY_HEADERS = ["cache", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "p99/p50", "median ms at growth / compaction steps", "that / p50"]


def latency_row(r):
    st = latency_stats(r["step_ms"])
    steps = structural_steps(r["kind"], len(r["step_ms"]))
    at = float(np.median(np.asarray(r["step_ms"])[steps])) if steps else float("nan")
    return [r["kind"], f"{st['p50_ms']:.2f}", f"{st['p99_ms']:.2f}", f"{st['p999_ms']:.1f}", f"{st['max_ms']:.1f}",
            f"{st['p99_over_p50']:.2f}", f"{at:.1f}", f"{at / st['p50_ms']:.1f}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per cache in the memory runs")
    # Not a multiple of 16 tokens (one 4 KiB page per head), so samples land mid-page too.
    ap.add_argument("--every", type=int, default=250, help="memory sample interval (tokens)")
    ap.add_argument("--decode-steps", type=int, default=4096, help="real-model decode steps (0: skip)")
    ap.add_argument("--kinds", nargs="*", default=["KVCache", "preallocated", "reserved"])
    ap.add_argument("--storage-kinds", nargs="*", default=["QuantizedKVCache", "reserved-quantized", "h2o-like/KVCache", "h2o-like/reserved"])
    ap.add_argument("--layout-contexts", nargs="*", type=int, default=[4096, 16384], help="contexts for the layout comparison")
    ap.add_argument("--no-allocator-probe", dest="allocator_probe", action="store_false")
    ap.add_argument("--plot", default="reserved.png")
    ap.add_argument("--json", default=None, help="save every measurement here")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: report (and plot) saved runs; later files fill in what earlier ones lack")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(memory_worker(args.worker, args.tokens, args.every)))
        return
    print(f"command: PYTHONPATH=src python3 benchmarks/{os.path.basename(__file__)} " + " ".join(sys.argv[1:]))
    if args.from_json:
        results = {}
        for path in args.from_json:
            with open(path) as f:
                results.update({k: v for k, v in json.load(f).items() if v})
    else:
        print(f"BLAS: {mlx_h2o.blas_backend()}  page: {os.sysconf('SC_PAGE_SIZE')} B  MLX {mx.__version__}")
        results = {"probe": allocator_probe() if args.allocator_probe else []}
        results["memory"] = [run_worker_subprocess(k, args.tokens, args.every) for k in tqdm(args.kinds, desc="memory runs", file=sys.stderr)]
        results["storage"] = [run_worker_subprocess(k, args.tokens, args.every) for k in tqdm(args.storage_kinds, desc="storage runs", file=sys.stderr)]
        results["decode"] = real_decode(args.decode_steps) if args.decode_steps > 0 else None
        results["layout"] = attention_layout(args.layout_contexts) if args.layout_contexts else []
        if args.json:
            write_json(args.json, results)
    report(results)
    if args.plot and (results.get("memory") or results.get("decode")):
        plot(results, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
