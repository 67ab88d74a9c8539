"""Which context-parallel strategy the analytic model (`tuner.models.strategy_model`) picks, and why, on 8 devices:
bf16, D=128, causal, zigzag, batch 1; heads 8 and 32, kv heads 1 and 8, 32k and 128k tokens; on an H100
SXM node (NVLink through NVSwitch) and on TPU v5e. Predictions of the model, never measurements.

    python benchmarks/strategies/strategy_table.py [--out FILE]

Prints a markdown table of each strategy's predicted forward + backward milliseconds and the pick, and
writes it (default benchmarks/strategies/results/strategy_model_table.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tuner.semantics.problem import Problem
from tuner.models.platforms import get_platform
from tuner.models.strategy_model import STRATEGIES, rank, verdict

RESULTS = Path(__file__).parent / "results"
PLATFORMS = ("h100", "v5e")
HEADS, KV_HEADS, SEQ_LENS = (8, 32), (1, 8), (32768, 131072)


def cell(prediction) -> str:
    if prediction.unsupported:
        return "n/a"
    axes = f" ({prediction.axes[0]}x{prediction.axes[1]})" if prediction.axes else ""
    return f"{prediction.seconds * 1e3:.1f}{axes}"


def build() -> str:
    lines = ["| platform | H | Hkv | S | " + " | ".join(f"{s} ms" for s in STRATEGIES) + " | pick: why |",
             "|---|---|---|---|" + "---|" * len(STRATEGIES) + "---|"]
    for platform in PLATFORMS:
        for heads in HEADS:
            for kv_heads in KV_HEADS:
                for seq_len in SEQ_LENS:
                    problem = Problem(batch=1, seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=128,
                                      dtype="bfloat16", causal=True, ring_size=8, layout="zigzag")
                    ranked = rank(problem, platform)
                    by_name = {t.strategy: t for t in ranked}
                    lines.append(f"| {platform} | {heads} | {kv_heads} | {seq_len} | "
                                 + " | ".join(cell(by_name[s]) for s in STRATEGIES) + f" | {verdict(ranked)} |")
    rates = [f"- {name}: {get_platform(name).source}" for name in PLATFORMS]
    return "\n".join([*lines, "", "Predicted forward + backward milliseconds of one attention call (the model's, not "
                                  "measured; hybrid: its fastest Pr x Pa split). Rates:", *rates])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "strategy_model_table.md")
    args = parser.parse_args()
    text = build()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
