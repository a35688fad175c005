"""`import dalle` as a notebook would use it: a grid from the demo model, low-rank adapters
fine-tuned on a few images of a combination the demo never saw, their loss plotted, and the
same prompt drawn before and after.

Run from the checkout, in the project's venv, after the README's set-up and build:
    ~/.cache/dalle/venv/bin/python examples/python/generate_and_finetune.py [--out runs/python-example]
(a few minutes on two cores). The images come from dalle.Pipeline; the training images are made
and encoded by the tools (dalle-data, dalle-encode-images), as the fine-tuning guide does.
"""
import argparse
import json
import os
import pathlib
import subprocess

from PIL import Image as PilImage

import dalle

MODEL = pathlib.Path("models/fashion-compose")
COMBINATION = "red sneaker"  # one of the demo's held-out combinations: the prior never saw it
PROMPTS = ["a red bag on the left", "a blue sneaker at the top", "a white trouser on the left",
           "a red sneaker on the right"]


def grid(images, columns):
    """One picture of the images, `columns` to a row."""
    side = images[0].size[0]
    rows = (len(images) + columns - 1) // columns
    sheet = PilImage.new("RGB", (columns * side, rows * side), "white")
    for index, picture in enumerate(images):
        sheet.paste(picture, ((index % columns) * side, (index // columns) * side))
    return sheet


def tool(name, *arguments):
    subprocess.run([str(pathlib.Path("build/tools") / name), *map(str, arguments)], check=True)


def training_images(out):
    """Token dataset of the composed images that show COMBINATION (a few hundred)."""
    composed = out / "composed"
    if not (composed / "heldout" / "captions.jsonl").exists():
        tool("dalle-data", "compose", "--config", "configs/data/fashion-compose.yaml", "--set", "train_images=0",
             "--set", "test_images=0", "--set", "heldout_images=1000", "--set", "seed=11", "--out", composed)
    train = out / "train"
    (train / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for line in (composed / "heldout" / "captions.jsonl").read_text().splitlines():
        record = json.loads(line)
        if COMBINATION not in record["caption"]:
            continue
        name = f"images/{len(lines):06d}.png"
        if not (train / name).exists():
            os.symlink((composed / "heldout" / record["image"]).resolve(), train / name)
        lines.append(json.dumps({**record, "image": name}))
    (train / "captions.jsonl").write_text("\n".join(lines) + "\n")
    tokens = out / "tokens"
    if not (tokens / "dataset.json").exists():
        tool("dalle-encode-images", "--dataset", train, "--vqgan", MODEL / "vqgan", "--tokenizer",
             MODEL / "tokenizer.model", "--out", tokens)
    print(f"{len(lines)} training images of a {COMBINATION}")
    return tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/python-example"))
    parser.add_argument("--steps", type=int, default=60, help="adapter updates")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # 1. A grid: two images per prompt, the best of 8 by CLIP score.
    base = dalle.Pipeline(MODEL, candidates=8)
    drawn = base.generate(PROMPTS, n=2, seed=7)
    grid([image.image for images in drawn for image in images], columns=4).save(args.out / "grid.png")
    print("grid:", args.out / "grid.png", [f"{images[0].clip_score:.2f}" for images in drawn])

    # 2. Adapters on the composed images of one combination, the base frozen.
    losses = []
    dalle.train("configs/prior/fashion-compose-adapters.yaml", args.out / "adapters",
                overrides={"data": {"train": str(training_images(args.out))}, "run": {"steps": args.steps}},
                on_metrics=lambda line: losses.append((line["step"], line["loss"])) if "loss" in line else None)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plt.plot(*zip(*losses))
        plt.xlabel("update")
        plt.ylabel("training loss")
        plt.savefig(args.out / "loss.png")
        print("loss:", args.out / "loss.png")
    except ImportError:
        print("loss by update (matplotlib would plot it):", losses)

    # 3. The same prompt before and after: the adapted run loads as a prior (its adapters folded in).
    adapted = dalle.Pipeline(MODEL, candidates=8, prior=str(args.out / "adapters"))
    prompt = PROMPTS[-1]
    pair = base.generate(prompt, n=2, seed=3) + adapted.generate(prompt, n=2, seed=3)
    grid([image.image for image in pair], columns=2).save(args.out / "before-after.png")
    print("before (top) and after (bottom):", args.out / "before-after.png")


if __name__ == "__main__":
    main()
