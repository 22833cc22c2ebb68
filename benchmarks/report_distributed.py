"""The identity table of a distributed run against one rank, from tests/distributed_worker.py's
outputs (rank{r}.json in each directory):

    python tests/distributed_worker.py --mode single --out ONE --tokens 160 --prefill 64
    mlx.launch --backend ring -n 3 --hosts 127.0.0.1 --connections-per-ip 1 --env MLX_H2O_NUM_THREADS=1 \\
        --python "$(command -v python)" tests/distributed_worker.py --mode tensor --out TP --tokens 160 --prefill 64
    python tests/distributed_worker.py --mode single --out NUDGED --tokens 160 --prefill 64 --nudge 1e-6   (and --nudge=-1e-6)
    python benchmarks/report_distributed.py ONE TP tensor [NUDGED ...]      (pipeline runs: ... ONE PP pipeline)

Per case: perplexity on one rank and on the group, their difference, whether every rank's NLL is
bit-equal, whether the ranks keep the same positions (shared selections) or each layer's one rank's
(pipeline), the KV bytes per rank against one rank, greedy tokens equal to one rank's, and whether
each rank's saved cache continues exactly. NUDGED directories (one rank with every o_proj output
scaled by 1 ± 1e-6, a perturbation of the size of an all-reduce's reordering) give each case's
noise floor: how far its perplexity moves by that alone (low-bit K/V rounding flips make 96 tokens of
a quantized cache move by a few percent).
"""

import json
import sys
from pathlib import Path

import numpy as np


def load(directory):
    files = sorted(Path(directory).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def positions_match(one, ranks, pipelined: bool):
    """Pipeline: each layer's positions are one rank's and equal one rank's run. Tensor: the ranks
    agree with each other (all of them per layer), and with one rank's heads."""
    if pipelined:
        for layer, held in enumerate(one["positions"]):
            owners = [r["positions"][layer] for r in ranks if r["positions"][layer] is not None]
            if owners != ([] if held is None else [held]):
                return "no"
        return "yes"
    same = all(r["positions"] == ranks[0]["positions"] for r in ranks)
    agree, total = 0, 0
    for layer, held in enumerate(one["positions"]):
        if held is None:
            continue
        heads = [h for lanes in held for row in lanes for h in row]  # one rank: (B, H, n) per lane
        mine = [h for r in ranks for lanes in r["positions"][layer] for row in lanes for h in row]
        for a, b in zip(heads, mine):
            total += 1
            agree += a == b
    return f"{'same on every rank' if same else 'per rank'}; {agree}/{total} heads as one rank"


def main():
    if len(sys.argv) < 4 or sys.argv[3] not in ("tensor", "pipeline"):
        sys.exit("usage: report_distributed.py ONE_RANK_DIR RANKS_DIR tensor|pipeline [NUDGED_DIR ...]")
    one, ranks = load(sys.argv[1])[0], load(sys.argv[2])
    nudged = [load(d)[0] for d in sys.argv[4:]]
    pipelined = sys.argv[3] == "pipeline"
    print(f"{len(ranks)} ranks, {'pipeline' if pipelined else 'tensor'} parallel, against one rank\n")
    print("| case | PPL one rank | PPL ranks | Δ | noise floor (±1e-6) | NLL equal on every rank | kept positions | "
          "KV bytes per rank / one rank | greedy = one rank | saved cache continues |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, ref in one.items():
        rs = [r[case] for r in ranks]
        a, b = np.exp(np.mean(ref["nll"])), np.exp(np.mean(rs[0]["nll"]))
        same_nll = all(r["nll"] == rs[0]["nll"] for r in rs)
        kv = [r["kv_bytes"] / max(ref["kv_bytes"], 1) for r in rs]
        greedy = sum(x == y for x, y in zip(rs[0]["greedy"], ref["greedy"]))
        resumed = all(r["greedy"] == r["greedy_after_load"] for r in rs)
        held = positions_match(ref, rs, pipelined) if any(p is not None for p in ref["positions"]) else "—"
        floor = [abs(np.exp(np.mean(n[case]["nll"])) / a - 1) * 100 for n in nudged if case in n]
        noise = f"{max(floor):.3f} %" if floor else "—"
        print(f"| {case} | {a:.4f} | {b:.4f} | {(b / a - 1) * 100:+.3f} % | {noise} | {'yes' if same_nll else 'no'} | {held} | "
              f"{' / '.join(f'{k:.4f}' for k in kv)} | {greedy}/{len(ref['greedy'])} | {'yes' if resumed else 'no'} |")


if __name__ == "__main__":
    main()
