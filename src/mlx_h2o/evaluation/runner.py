"""Several cache policies on identical token sequences in one run -> rows for one table.

A policy spec is `name` or `name:key=value,key=value` (e.g. `rotating:max_kv_size=128`,
`h2o:max_kv_size=256,score=ema`), values parsed by the policy's option table. Bounded policies
(those with a `max_kv_size` option) are expanded over every size in `max_kv_sizes` unless the spec
fixes one. Options shared by several policies (`--kv-option KEY=VALUE`) reach every listed policy that
has the option, below the spec's own.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..caches import POLICIES, make_cache
from ..options import parse_key_values
from .batched import policy_batch, policy_kv_bytes
from .memory import memory_snapshot
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


def parse_specs(specs: Sequence[str], max_kv_sizes: Sequence[int] = (), options: Optional[Mapping[str, str]] = None) -> List[PolicySpec]:
    """`specs` as PolicySpecs. `options` ({key: text}, e.g. from --kv-option KEY=VALUE) go to every
    listed policy that has the option, unless its spec sets it; a key no listed policy has is a
    ValueError naming the policies and their options."""
    parsed = []
    for spec in specs:
        name, _, rest = spec.partition(":")
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r} (in {spec!r})")
        policy = POLICIES[name]
        parsed.append((policy, policy.parse_options(parse_key_values(list(filter(None, rest.split(","))), "policy option"))))
    shared = dict(options or {})
    for key in shared:
        if not any(policy.takes(key) for policy, _ in parsed):
            listed = "; ".join(f"{p.name}: {', '.join(o.name for o in p.options) or 'no options'}" for p in {p.name: p for p, _ in parsed}.values())
            raise ValueError(f"option {key!r} is not an option of any listed policy ({listed}); "
                             "`mlx-h2o options NAME` prints a policy's options")
    out = []
    for policy, own in parsed:
        name = policy.name
        given = {}
        for key, text in shared.items():
            if key in own or not policy.takes(key):
                continue
            try:
                given[key] = policy.option(key).parse(text)
            except ValueError as e:
                raise ValueError(f"option {key}={text} of policy {name!r}: {e}") from None
        opts = {**given, **own}
        if given and "max_kv_size" in opts:
            opts = {"max_kv_size": opts["max_kv_size"], **opts}  # the budget first, as in the labels
        if policy.bounded and not {"max_kv_size", "max_kv_bytes"} & set(opts):
            if not max_kv_sizes:
                raise ValueError(f"policy {name!r} needs a budget: give --max-kv-size, --kv-option max_kv_size=M or {name}:max_kv_size=M")
            out += [PolicySpec(name, {"max_kv_size": m, **opts}) for m in max_kv_sizes]
        else:
            out.append(PolicySpec(name, opts))
    return out


def perplexity_table(
    model,
    specs: Sequence[PolicySpec],
    samples: Sequence[tuple],
    prefill: int = 32,
    batch_size: Optional[int] = None,
    progress: bool = True,
    policy_batch_size: int = 1,
    score_after_prefill: bool = False,
) -> List[dict]:
    """Autoregressive PPL of every spec over the same `samples` [(doc id, tokens)], batched.

    Every token after the first is scored, or with `score_after_prefill` only those predicted after
    the prefill call (kvpress's protocol: a context compressed once, then the NLL of what follows).

    `policy_batch_size` > 1 decodes that many policies together, each over its own rows of one
    batch (evaluation/batched.py: the same NLLs, the weights read once per step for all of them);
    their rows then share `seconds` and `tok_s`. Rows carry PPL, ΔPPL % vs the full cache (when
    "full" is among the specs), KV bytes per sequence at the end, peak MLX memory and throughput.
    """
    tokens = np.array([s[1] for s in samples], dtype=np.int32)
    n, length = tokens.shape
    batch_size = batch_size or n
    if policy_batch_size < 1:
        raise ValueError(f"policy_batch_size must be >= 1, got {policy_batch_size}")
    rows = []
    for g in range(0, len(specs), policy_batch_size):
        group = specs[g : g + policy_batch_size]
        nll = {i: [] for i in range(len(group))}
        kv = {i: [] for i in range(len(group))}
        mem_peak = 0
        t0 = time.perf_counter()
        label = ", ".join(s.label for s in group)
        with tqdm(total=n * (length - 1), desc=label[:80], unit="tok", disable=not progress, leave=False) as bar:
            for i in range(0, n, batch_size):
                batch = tokens[i : i + batch_size]
                b = len(batch)
                caches = policy_batch([make_cache(model, s.policy, **s.options) for s in group], b)
                out = autoregressive_nll(model, np.concatenate([batch] * len(group)), caches, prefill=prefill,
                                         progress=lambda k: bar.update(k * b))
                for p in range(len(group)):
                    nll[p].append(out[p * b : (p + 1) * b])
                    kv[p].append(policy_kv_bytes(caches, p) / b)
                mem_peak = max(mem_peak, memory_snapshot()["mlx_peak_bytes"])
        seconds = time.perf_counter() - t0
        for p, spec in enumerate(group):
            x = np.concatenate(nll[p], axis=0)
            if score_after_prefill:
                x = x[:, prefill:]
            rows.append(
                {
                    "label": spec.label,
                    "policy": spec.policy,
                    "options": dict(spec.options),
                    "max_kv_size": spec.options.get("max_kv_size"),
                    "seq_len": length,
                    "samples": n,
                    "ppl": math.exp(x.mean()),
                    "sample_ppl": [math.exp(v) for v in x.mean(axis=1)],
                    "kv_bytes_per_seq": float(np.mean(kv[p])),
                    "mlx_peak_bytes": mem_peak,
                    "seconds": seconds,
                    "tok_s": len(group) * n * (length - 1) / seconds,
                    "policies_batched": len(group),
                    "scored": x.shape[1],
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
