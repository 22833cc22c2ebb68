"""Every buffer above 1 MiB in a decode process, and what holds it: the embedded SmolLM2 GGUF, a cache,
a prompt of --context real tokens prefilled as bench_peer.py does (512-token chunks, mlx-lm's
`generate_step`), then --gen greedy tokens. At the end of the decode it lists:

- MLX's arrays that Python reaches (the model's parameters, the cache's state, anything else alive),
  one row per buffer of at least --min-mib (views of one buffer count once), and the totals per owner;
- MLX's allocator: active memory (what arrays hold), its buffer cache (freed buffers kept for reuse)
  and the peak over the run;
- the process's memory maps with at least --min-mib resident (/proc/self/smaps): libraries, the
  interpreter's heap, MLX's and the allocator's anonymous regions; and the peak RSS.

    python benchmarks/audit_memory.py [--context 2048] [--gen 16] [--cache full] [--budget 512] [--min-mib 1]
        [--allocator glibc|mmap] [--json out.json]

Memory only: nothing here is timed, so it may run on a busy machine.
"""

import argparse
import gc
import json
import os
import sys

MIB = 1 << 20


def array_extent(a):
    """(first byte, end) of the memory array `a` reads: its data pointer and the span its shape and
    strides cover. None where NumPy cannot view it (e.g. bfloat16)."""
    import numpy as np

    try:
        view = np.asarray(a)
    except (TypeError, ValueError, RuntimeError):
        return None
    start = view.__array_interface__["data"][0]
    if view.size == 0:
        return start, start
    span = sum((n - 1) * abs(s) for n, s in zip(view.shape, view.strides)) + view.itemsize
    return start, start + span


def merge_extents(rows):
    """rows: (start, end, owner, name, shape, dtype). Overlapping extents are one buffer (views of it,
    or arrays sharing it): returns (start, end, [rows]) per buffer, in address order."""
    buffers = []
    for row in sorted(rows, key=lambda r: (r[0], -r[1])):
        if buffers and row[0] < buffers[-1][1]:
            start, end, members = buffers[-1]
            buffers[-1] = (start, max(end, row[1]), members + [row])
        else:
            buffers.append((row[0], row[1], [row]))
    return buffers


def reachable_arrays(model, cache):
    """(owner, name, array) for every mx.array Python reaches: parameters, cache state, the rest."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out, seen = [], set()

    def add(owner, name, a):
        if isinstance(a, mx.array) and id(a) not in seen:
            seen.add(id(a))
            out.append((owner, name, a))

    def walk(owner, name, value, depth, visited):
        """Every array reachable from a cache's attributes (its stores, columns, spare room, views)."""
        if isinstance(value, mx.array):
            return add(owner, name, value)
        if depth == 0 or id(value) in visited:
            return
        visited.add(id(value))
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            items = vars(value).items()
        else:
            return
        for k, v in items:
            walk(owner, f"{name}.{k}", v, depth - 1, visited)

    for name, a in tree_flatten(model.parameters()):
        add("model parameters", name, a)
    for i, c in enumerate(cache):
        walk("KV cache", f"layer {i}", c, 8, set())
    for obj in gc.get_objects():
        add("other live arrays", type(obj).__name__, obj)
    return out


def smaps_regions(min_bytes):
    """(Rss bytes, Private_Dirty bytes, mapping name) per mapping name with at least min_bytes resident."""
    from mlx_h2o.evaluation.memory import memory_maps

    grouped = {}
    for _, _, name, fields in memory_maps():
        g = grouped.setdefault(name or "[anonymous]", [0, 0])
        g[0] += fields.get("Rss", 0)
        g[1] += fields.get("Private_Dirty", 0)
    return sorted(((rss, dirty, name) for name, (rss, dirty) in grouped.items() if rss >= min_bytes), reverse=True)


def rss_now_and_peak():
    """(resident, peak resident) bytes of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    from bench_peer import peak_rss_mib  # VmHWM: this process's own peak, as bench_peer's workers report

    return rss, int(peak_rss_mib() * MIB)


def malloc_trim():
    """Give the C allocator's free heap memory back to the system (glibc); False where there is none."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens before the decode")
    ap.add_argument("--gen", type=int, default=16, help="greedy tokens decoded")
    ap.add_argument("--cache", default="full", metavar="SPEC", help="policy spec, as bench_peer.py's --caches")
    ap.add_argument("--budget", type=int, default=512, help="max_kv_size of a bounded cache given without one")
    ap.add_argument("--min-mib", type=float, default=1.0, help="list buffers and mappings of at least this many MiB")
    ap.add_argument("--allocator", choices=["glibc", "mmap"], default="glibc",
                    help="glibc: the C allocator's own mmap threshold, as a process runs by default; mmap: freed "
                         "large buffers returned to the system (mlx_h2o.use_mmap_for_large_buffers, limit_mlx_buffer_cache)")
    ap.add_argument("--json", help="also write the audit here")
    args = ap.parse_args()

    stages = [("interpreter", *rss_now_and_peak())]
    import mlx_h2o  # isort: skip

    mlx_h2o.use_openblas()  # before mlx.core loads, as bench_peer.py
    if args.allocator == "mmap":
        mlx_h2o.use_mmap_for_large_buffers()
        mlx_h2o.limit_mlx_buffer_cache()
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from bench_peer import PREFILL_CHUNK
    from mlx_h2o.evaluation import load_corpus, token_samples
    from mlx_h2o.evaluation.runner import parse_specs

    stages.append(("imports (mlx, mlx-lm, mlx-h2o)", *rss_now_and_peak()))
    print(f"loading the model and {args.context} prompt tokens ...", flush=True)
    model, tokenizer = mlx_h2o.load()
    stages.append(("model and tokenizer loaded", *rss_now_and_peak()))
    tokens = token_samples(tokenizer, load_corpus(), 1, args.context, seed=1)[0][1]
    gc.collect()
    stages.append(("prompt tokens made (the corpus read and freed)", *rss_now_and_peak()))
    (policy,) = parse_specs([args.cache], [args.budget])
    cache = mlx_h2o.make_cache(model, policy.policy, **policy.options)
    mx.reset_peak_memory()
    print(f"prefill and {args.gen} decode steps, cache {args.cache}, allocator {args.allocator} ...", flush=True)
    steps = generate_step(mx.array(tokens), model, max_tokens=args.gen, sampler=lambda lp: mx.argmax(lp, axis=-1),
                          prompt_cache=cache, prefill_step_size=PREFILL_CHUNK)
    for _ in steps:
        pass
    del steps
    gc.collect()
    mx.synchronize()
    stages.append((f"prefill and {args.gen} decode steps", *rss_now_and_peak()))

    min_bytes = int(args.min_mib * MIB)
    rows, unviewable = [], []
    for owner, name, a in reachable_arrays(model, cache):
        ext = array_extent(a)
        if ext is None:
            unviewable.append((owner, name, a.nbytes))
        else:
            rows.append((*ext, owner, name, tuple(a.shape), str(a.dtype)))
    buffers = merge_extents(rows)
    per_owner = {}
    for start, end, members in buffers:
        owner = members[0][2]
        per_owner.setdefault(owner, [0, 0, 0])
        per_owner[owner][0] += end - start
        per_owner[owner][1] += 1
        per_owner[owner][2] += end - start >= min_bytes
    big = sorted((b for b in buffers if b[1] - b[0] >= min_bytes), key=lambda b: b[0] - b[1])

    print(f"\nMLX arrays Python reaches at the end of the decode: {len(rows)} arrays in {len(buffers)} buffers")
    print("| owner | buffers | of them >= %g MiB | MiB |" % args.min_mib)
    print("|---|---|---|---|")
    for owner, (nbytes, count, n_big) in sorted(per_owner.items(), key=lambda kv: -kv[1][0]):
        print(f"| {owner} | {count} | {n_big} | {nbytes / MIB:.2f} |")
    print(f"\nbuffers of at least {args.min_mib:g} MiB ({len(big)}):")
    print("| MiB | owner | array (first of the views) | shape | dtype | views |")
    print("|---|---|---|---|---|---|")
    for start, end, members in big:
        _, _, owner, name, shape, dtype = members[0]
        print(f"| {(end - start) / MIB:.2f} | {owner} | {name} | {shape} | {dtype} | {len(members)} |")
    if unviewable:
        print(f"(not viewable by NumPy, not counted above: {len(unviewable)} arrays, "
              f"{sum(n for *_, n in unviewable) / MIB:.2f} MiB)")

    active, cached, peak = mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory()
    reached = sum(end - start for start, end, _ in buffers)
    print("\nMLX's allocator:")
    print(f"| active MiB | of it reached from Python | MLX buffer cache MiB | peak since the prompt MiB |")
    print("|---|---|---|---|")
    print(f"| {active / MIB:.2f} | {reached / MIB:.2f} | {cached / MIB:.2f} | {peak / MIB:.2f} |")

    regions = smaps_regions(min_bytes)
    peak_rss = rss_now_and_peak()[1]
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: line.split(":")[1].strip() for line in f}
    print(f"\nprocess memory maps with at least {args.min_mib:g} MiB resident (RSS now {status['VmRSS']}, "
          f"peak {peak_rss / MIB:.1f} MiB; anonymous {status.get('RssAnon')}, files {status.get('RssFile')}):")
    regions = [(rss, dirty, os.path.basename(name) if name.startswith("/") else name) for rss, dirty, name in regions]
    print("| RSS MiB | private dirty MiB | mapping |")
    print("|---|---|---|")
    for rss, dirty, name in regions:
        print(f"| {rss / MIB:.2f} | {dirty / MIB:.2f} | {name} |")

    trimmed = malloc_trim()
    stages.append(("then malloc_trim(0): free heap returned" if trimmed else "(no malloc_trim here)", *rss_now_and_peak()))
    print("\nthe process's resident memory by stage:")
    print("| stage | RSS MiB | peak RSS so far MiB |")
    print("|---|---|---|")
    for name, rss, peak_so_far in stages:
        print(f"| {name} | {rss / MIB:.1f} | {peak_so_far / MIB:.1f} |")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(context=args.context, gen=args.gen, cache=args.cache, allocator=args.allocator,
                           per_owner={k: dict(bytes=v[0], buffers=v[1]) for k, v in per_owner.items()},
                           buffers=[dict(bytes=e - s, owner=m[0][2], name=m[0][3], shape=m[0][4], dtype=m[0][5],
                                         views=len(m)) for s, e, m in big],
                           mlx=dict(active=active, reached=reached, cache=cached, peak=peak),
                           stages=[dict(stage=n, rss=r, peak_rss=p) for n, r, p in stages],
                           process=dict(peak_rss=peak_rss, rss=status["VmRSS"], anon=status.get("RssAnon"),
                                        file=status.get("RssFile"),
                                        maps=[dict(rss=r, private_dirty=d, name=n) for r, d, n in regions])), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
