#!/usr/bin/env python3
"""Converts a ruCLIP model, the reranker of ruDALL-E's README (the `ruclip` package; its
released folders sberbank-ai/ruclip-vit-base-patch32-384, -224, ... on the Hugging Face hub),
into a dalle CLIP checkpoint directory (config.yaml, model.safetensors, state.safetensors)
that the C++ API (dalle::models::load_trained_clip) loads by name. Needs only torch and
safetensors (the project's venv); the ruclip package is not imported, and dalle itself never
downloads anything:

    ~/.cache/dalle/venv/bin/python scripts/export_ruclip.py \\
        --from downloads/ruclip-vit-base-patch32-384 --out checkpoints/ruclip

The folder holds ruclip's released files, as ruclip.load fetches them:
  * config.json: embed_dim, image_resolution, vision_layers, vision_width,
    vision_patch_size, context_length, vocab_size, transformer_width, transformer_heads,
    transformer_layers, and optionally the images' mean and std;
  * pytorch_model.bin: the state dict of ruclip.model.CLIP, which CLIP.from_pretrained loads
    strictly;
  * bpe.model: its YouTokenToMe tokenizer. Not copied here: the pipeline reads it as
    `clip_tokenizer` (scripts/import-model clip copies it into a model folder).

ruclip 0.0.2's CLIP is OpenAI CLIP's ViT under OpenAI's names, so the name mapping is the
identity (export_open_clip.py's checks and writer are reused). What the config says:
  * sizes from the tensors (export_open_clip.sizes), each checked against config.json;
  * vision heads vision_width // 64 (ruclip fixes them so), text heads transformer_heads;
  * activation quick_gelu (ruclip's blocks use QuickGELU);
  * text_pooling eos at eos_id 3: ruclip's encode_text reads the feature where the ids are
    its eos_id, 3 by default (from_pretrained passes none), which RuCLIPProcessor writes
    after BOS 2 and the ids;
  * preprocess ruclip: RuCLIPProcessor's RandomResizedCrop(image_resolution, scale=(1, 1),
    ratio=(1, 1)), the centred square then a bilinear resize (clip.h);
  * image_mean and image_std: config.json's mean and std when given, else CLIP's (ruclip's
    defaults).
"""
import argparse
import json
import pathlib

import torch

from export_open_clip import DROPPED, checked_tensors, sizes, write_checkpoint

RELEASED = ("config.json", "pytorch_model.bin", "bpe.model")
EOS_ID = 3  # ruclip.model.CLIP's default eos_id and RuCLIPProcessor.eos_id
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # RuCLIPProcessor's defaults
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# config.json's keys and what export_open_clip.sizes calls them.
RELEASED_SIZES = {"embed_dim": "embed_dim", "image_resolution": "image_size", "vision_layers": "vision_layers",
                  "vision_width": "vision_width", "vision_patch_size": "patch_size",
                  "context_length": "context_length", "vocab_size": "vocab_size", "transformer_width": "text_width",
                  "transformer_heads": "text_heads", "transformer_layers": "text_layers"}


def is_release(folder):
    """Whether `folder` holds ruCLIP's released files (the layout ruclip.load downloads)."""
    folder = pathlib.Path(folder)
    return folder.is_dir() and all((folder / name).is_file() for name in RELEASED)


def read_release(folder):
    """config.json and the state dict of a ruCLIP folder."""
    folder = pathlib.Path(folder)
    for name in RELEASED:
        if not (folder / name).is_file():
            raise SystemExit(f"{folder}: no {name} (a ruCLIP folder holds {', '.join(RELEASED)})")
    released = json.loads((folder / "config.json").read_text())
    missing = [key for key in RELEASED_SIZES if key not in released]
    if missing:
        raise SystemExit(f"{folder / 'config.json'}: lacks {', '.join(missing)}; not a ruclip config")
    state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SystemExit(f"{folder / 'pytorch_model.bin'}: expected a state dict of tensors")
    return released, state


def channel_values(released, key, fallback):
    values = released.get(key) or fallback
    if len(values) != 3 or not all(isinstance(v, (int, float)) for v in values):
        raise SystemExit(f"config.json: {key} must be three numbers (R, G, B), got {values!r}")
    return [float(v) for v in values]


def checkpoint_config(released, state, where):
    """dalle's Clip config for ruclip's `released` config.json and `state`."""
    width = released["vision_width"]
    if width % 64 != 0:
        raise SystemExit(f"{where}: vision_width {width} is not a multiple of 64, ruclip's head width")
    if released["transformer_width"] % released["transformer_heads"] != 0:
        raise SystemExit(f"{where}: transformer_width {released['transformer_width']} is not a multiple of "
                         f"transformer_heads {released['transformer_heads']}")
    config = sizes(state, vision_heads=width // 64, text_heads=released["transformer_heads"])
    for key, ours in RELEASED_SIZES.items():
        if config[ours] != released[key]:
            raise SystemExit(f"{where}: config.json's {key} is {released[key]}, the weights' {config[ours]}")
    if config["mlp_ratio"] != 4.0:
        raise SystemExit(f"{where}: MLP ratio {config['mlp_ratio']}; ruclip's blocks have 4")
    if config["vocab_size"] <= EOS_ID:
        raise SystemExit(f"{where}: vocab_size {config['vocab_size']} has no end-of-text id {EOS_ID}")
    return config | {"activation": "quick_gelu", "text_pooling": "eos", "eos_id": EOS_ID, "preprocess": "ruclip",
                     "image_mean": channel_values(released, "mean", CLIP_MEAN),
                     "image_std": channel_values(released, "std", CLIP_STD)}


def export(folder, out):
    released, state = read_release(folder)
    where = f"ruCLIP {folder}"
    state = {k: v for k, v in state.items() if k not in DROPPED}
    config = checkpoint_config(released, state, where)
    write_checkpoint(out, checked_tensors(state, config, where), config, where)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", required=True,
                        help="folder of ruCLIP's released config.json, pytorch_model.bin and bpe.model")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    args = parser.parse_args()
    export(args.source, args.out)


if __name__ == "__main__":
    main()
