"""Write a routing trace for any depth and expert count with the statistics of a real MoE's decode
routing (edgemoe.scheduling.synthetic_routing; defaults: a Mixtral-8x7B decode trace's), and print the
statistics it has. For benchmarks of random-weight models: `edgemoe bench STORE --replay TRACE`.

    python tools/make_routing_trace.py --layers 32 --experts 8 --top-k 2 --sequences 8 --tokens 256 \\
        -o mixtral-like.jsonl [--stay-excess 0.16] [--top-share-ratio 1.48] [--predictability-excess 0.287]
        [--second-weight-median 0.305] [--second-weight-below-0.2 0.275] [--entropy H] [--seed 0] [--model-seed 0]

--entropy sets the popularity's skew by its normalized entropy (1 = flat) instead of --top-share-ratio:
public routing logs of fine-grained models (64 experts, top-8) range from about 0.98 to 0.85.

--model-seed draws the "model" (popularity and the layer-to-layer tables), --seed the tokens: traces
of one model seed and other seeds are other texts through the same model (profile from one, replay
another).

Compare with a recorded trace: edgemoe simulate TRACE --cache-experts N --stats
"""

from __future__ import annotations

import argparse

from edgemoe.scheduling.profile import write_trace
from edgemoe.scheduling.synthetic_routing import RoutingTargets, generate


def main() -> None:
    defaults = RoutingTargets()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="MoE layers (0 .. layers-1)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--out", "-o", required=True)
    parser.add_argument("--seed", type=int, default=0, help="the tokens")
    parser.add_argument("--model-seed", type=int, default=0, help="the model's routing tables")
    parser.add_argument("--stay-excess", type=float, default=defaults.stay_excess)
    parser.add_argument("--top-share-ratio", type=float, default=defaults.top_share_ratio)
    parser.add_argument("--predictability-excess", type=float, default=defaults.predictability_excess)
    parser.add_argument("--second-weight-median", type=float, default=defaults.second_weight_median)
    parser.add_argument("--second-weight-below-0.2", dest="below", type=float,
                        default=defaults.second_weight_below_0_2)
    parser.add_argument("--entropy", type=float, default=None,
                        help="normalized popularity entropy (instead of --top-share-ratio)")
    args = parser.parse_args()
    targets = RoutingTargets(args.stay_excess, args.top_share_ratio, args.predictability_excess,
                             args.second_weight_median, args.below, args.entropy)
    records, stats = generate(args.layers, args.experts, args.top_k, args.sequences, args.tokens, targets,
                              args.seed, args.model_seed)
    write_trace(args.out, records)
    want = targets.absolute(args.experts, args.top_k)
    print(f"wrote {args.out}: {len(records)} records; targets: stay {want['stay']:.3f}, top share "
          f"{want['top_share']:.3f}, predictability {want['predictability']:.3f} (in-sample)")
    for line in stats.lines():
        print(f"  {line}")


if __name__ == "__main__":
    main()
