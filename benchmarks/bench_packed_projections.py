"""Decode speed with q/k/v and gate/up as one packed product each (cpu_layers.PackedProjections, what
`mlx_h2o.load()` switches in) against the projections one by one, through mlx-lm's `generate_step`.

    python benchmarks/bench_packed_projections.py [--context 512] [--caches full h2o:max_kv_size=256] [--rounds 8] [--steps 128]

One process, one model: for each cache spec the two alternate round by round (the order flips every
round), each round a fresh cache, the same prompt (GPL-3 text) and greedy decoding (bench_flat_blocks'
`alternate`). Prints tok/s per round, the medians and their ratio, the median Python time to build a
step's graph, and whether both decoded the same tokens (they must: each output column gets the same
integer dots). `uptime` before and after: timings on a busy machine are not results.
"""

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # prefill's GEMMs; before mlx.core loads

from bench_flat_blocks import run_alternating


def packed_arms(model):
    packed = [(b, vars(b).get("_packed_qkv"), b.mlp, vars(b.mlp).get("_packed_gate_up")) for b in model.model.layers]
    if not all(qkv is not None and gate_up is not None for _, qkv, _, gate_up in packed):
        raise SystemExit("the model's projections are not packed: nothing to compare")

    def set_packed(on: bool):
        for block, qkv, mlp, gate_up in packed:
            block._packed_qkv, mlp._packed_gate_up = (qkv, gate_up) if on else (None, None)

    return {"one product each": lambda: set_packed(False), "packed: q/k/v, gate/up": lambda: set_packed(True)}


if __name__ == "__main__":
    run_alternating(__doc__, "packed", packed_arms)
