"""Draw docs/figures/tiers.png: how a question is answered (the two tiers, and idle work
filling them). Run: .venv/bin/python scripts/draw_tiers.py"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {  # name: (x, y, width, height, text, colour)
    "question": (0.2, 3.0, 2.2, 0.9, "question", "#dfe7f2"),
    "prompt": (3.2, 3.0, 2.6, 0.9, "retrieve chunks,\nlay out the prompt", "#dfe7f2"),
    "stored": (6.6, 4.3, 3.2, 0.9, "QA bank: this prompt\nanswered before?", "#f6e7c8"),
    "states": (6.6, 3.0, 3.2, 0.9, "chunk-state tree: restore\nthe longest stored prefix", "#d9eedb"),
    "model": (6.6, 1.7, 3.2, 0.9, "llama.cpp: prefill the rest,\ndecode (stored answers as drafts)", "#e7e2f3"),
    "answer": (10.6, 3.0, 2.0, 0.9, "the same answer\nas without a cache", "#dfe7f2"),
    "idle": (3.2, 0.3, 6.6, 0.9, "idle time: predict questions; prefill their paths and store their answers", "#f3dede"),
}
ARROWS = [
    ("question", "prompt"), ("prompt", "stored"), ("prompt", "states"), ("states", "model"),
    ("stored", "answer"), ("model", "answer"), ("idle", "states"),
]


def centre(name: str, side: str) -> tuple[float, float]:
    x, y, w, h, _, _ = BOXES[name]
    return {"left": (x, y + h / 2), "right": (x + w, y + h / 2), "top": (x + w / 2, y + h), "bottom": (x + w / 2, y)}[side]


def main() -> None:
    fig, ax = plt.subplots(figsize=(12.8, 5.4), dpi=100)
    ax.set_xlim(0, 12.8)
    ax.set_ylim(0, 5.6)
    ax.axis("off")
    for x, y, w, h, text, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#555555"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=10)
    for start, end in ARROWS:
        if start == "idle":  # up from the idle box, then into the tree from the left
            a, b = (5.6, BOXES[start][1] + BOXES[start][3]), (BOXES[end][0], BOXES[end][1] + 0.25)
            ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=14, color="#444444",
                                         linestyle="--", connectionstyle="angle,angleA=90,angleB=0"))
            continue
        if BOXES[end][1] == BOXES[start][1]:
            a, b = centre(start, "right"), centre(end, "left")
        elif start == "states":
            a, b = centre(start, "bottom"), centre(end, "top")
        else:
            a, b = centre(start, "right"), centre(end, "left")
        style = "->" if start != "idle" else "-|>"
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=14, color="#444444",
                                     linestyle="--" if start == "idle" else "-"))
    ax.text(6.6, 5.3, "an identical prompt needs no model", fontsize=9, style="italic", color="#555555")
    out = Path(__file__).resolve().parents[1] / "docs" / "figures" / "tiers.png"
    fig.savefig(out, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
