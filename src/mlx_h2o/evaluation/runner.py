"""Several cache policies on identical token sequences in one run -> rows for one table.

A policy spec is `name` or `name:key=value,key=value` (e.g. `rotating:max_kv_size=128`,
`h2o:max_kv_size=256,score=ema`), values parsed by the policy's option table. Bounded policies
(those with a `max_kv_size` option) are expanded over every size in `max_kv_sizes` unless the spec
fixes one.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..caches import POLICIES, make_cache
from ..options import parse_key_values
from .memory import kv_bytes, memory_snapshot
from .perplexity import autoregressive_nll
from .speed import decode_benchmark


@dataclass
class PolicySpec:
    policy: str
    options: Dict[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.policy
        opts = ",".join(f"{'M' if k == 'max_kv_size' else k}={v}" for k, v in self.options.items())
        return f"{self.policy}({opts})"


def parse_specs(specs: Sequence[str], max_kv_sizes: Sequence[int] = ()) -> List[PolicySpec]:
    out = []
    for spec in specs:
        name, _, rest = spec.partition(":")
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r} (in {spec!r})")
        policy = POLICIES[name]
        options = policy.parse_options(parse_key_values(list(filter(None, rest.split(","))), "policy option"))
        if policy.bounded and "max_kv_size" not in options:
            if not max_kv_sizes:
                raise ValueError(f"policy {name!r} needs a budget: give --max-kv-size or {name}:max_kv_size=M")
            out += [PolicySpec(name, {"max_kv_size": m, **options}) for m in max_kv_sizes]
        else:
            out.append(PolicySpec(name, options))
    return out


def _make_batch_cache(model, spec: PolicySpec):
    return make_cache(model, spec.policy, **spec.options)


def perplexity_table(
    model,
    specs: Sequence[PolicySpec],
    samples: Sequence[tuple],
    prefill: int = 32,
    batch_size: Optional[int] = None,
    progress: bool = True,
) -> List[dict]:
    """Autoregressive PPL of every spec over the same `samples` [(doc id, tokens)], batched.

    Rows carry PPL, ΔPPL % vs the full cache (when "full" is among the specs), KV bytes per
    sequence at the end, peak MLX memory and throughput.
    """
    tokens = np.array([s[1] for s in samples], dtype=np.int32)
    n, length = tokens.shape
    batch_size = batch_size or n
    rows = []
    for spec in specs:
        nll = []
        kv = []
        mem_peak = 0
        t0 = time.perf_counter()
        with tqdm(total=n * (length - 1), desc=spec.label, unit="tok", disable=not progress, leave=False) as bar:
            for i in range(0, n, batch_size):
                batch = tokens[i : i + batch_size]
                cache = _make_batch_cache(model, spec)
                nll.append(autoregressive_nll(model, batch, cache, prefill=prefill, progress=lambda k: bar.update(k * len(batch))))
                kv.append(kv_bytes(cache) / len(batch))
                mem_peak = max(mem_peak, memory_snapshot()["mlx_peak_bytes"])
        seconds = time.perf_counter() - t0
        nll = np.concatenate(nll, axis=0)
        rows.append(
            {
                "label": spec.label,
                "policy": spec.policy,
                "options": dict(spec.options),
                "max_kv_size": spec.options.get("max_kv_size"),
                "seq_len": length,
                "samples": n,
                "ppl": math.exp(nll.mean()),
                "sample_ppl": [math.exp(x) for x in nll.mean(axis=1)],
                "kv_bytes_per_seq": float(np.mean(kv)),
                "mlx_peak_bytes": mem_peak,
                "seconds": seconds,
                "tok_s": n * (length - 1) / seconds,
            }
        )
    full = [r["ppl"] for r in rows if r["policy"] == "full"]
    for r in rows:
        r["delta_pct"] = 100.0 * (r["ppl"] / full[0] - 1.0) if full else None
    return rows


def speed_table(model, specs: Sequence[PolicySpec], context_tokens, steps: int = 64, progress: bool = True) -> List[dict]:
    rows = []
    for spec in specs:
        cache = make_cache(model, spec.policy, **spec.options)
        with tqdm(total=len(context_tokens) - 1, desc=f"prefill {spec.label}", unit="tok", disable=not progress, leave=False) as bar:
            r = decode_benchmark(model, cache, context_tokens, steps=steps, progress=bar.update)
        rows.append({"label": spec.label, "policy": spec.policy, "options": dict(spec.options), **r})
    return rows
