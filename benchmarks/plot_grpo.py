"""Plot and tabulate a GRPO run logged by ``examples/grpo_loop.py --log-json``.

    python benchmarks/plot_grpo.py benchmarks/results/grpo_smollm2/grpo.json

writes ``grpo.png`` (mean reward and response lengths per iteration) beside the log
and prints the per-iteration table as Markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = [
    ("iteration", "iter", "{}"),
    ("rollout_s", "rollout s", "{:.1f}"),
    ("tokens", "tokens", "{}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("mean_reward", "mean reward", "{:.3f}"),
    ("mixed_groups", "mixed groups", "{}"),
    ("mean_len", "mean len", "{:.1f}"),
    ("max_len", "max len", "{}"),
    ("loss", "loss", "{:.5f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("logp_gap", "logp gap", "{:.2e}"),
    ("train_s", "train s", "{:.1f}"),
    ("update_s", "update s", "{:.1f}"),
    ("weight_version", "version", "{}"),
]


def table(records: list[dict], groups: int) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        cells = []
        for key, _, fmt in COLUMNS:
            value = r.get(key)
            cell = "n/a" if value is None else fmt.format(value)
            cells.append(f"{cell}/{groups}" if key == "mixed_groups" else cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [r["iteration"] for r in records]
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax_r.plot(it, [r["mean_reward"] for r in records], marker="o")
    ax_r.set_ylabel("mean reward")
    ax_r.set_ylim(0, 1)
    ax_l.plot(it, [r["mean_len"] for r in records], marker="o", label="mean")
    ax_l.plot(it, [r["max_len"] for r in records], marker="s", label="max")
    ax_l.set_ylabel("response tokens")
    ax_l.legend(fontsize=8)
    for ax in (ax_r, ax_l):
        ax.set_xlabel("iteration")
        ax.set_xticks(it)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="the JSON written by grpo_loop.py --log-json")
    args = p.parse_args()
    path = Path(args.log)
    log = json.loads(path.read_text())
    cfg, records = log["config"], log["iterations"]
    title = (f"GRPO on {cfg['model']}: {cfg['task']}, {cfg['batch_prompts']} prompts x n={cfg['n']} per "
             f"iteration via {cfg['via']}")  # fmt: skip
    plot(records, path.with_name("grpo.png"), title)
    print(table(records, cfg["batch_prompts"]))


if __name__ == "__main__":
    main()
