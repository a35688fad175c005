#!/usr/bin/env python3
"""Converts ruDALL-E's released transformer (the `pytorch_model_v3.bin` state dict of
Malevich, or of any `rudalle` DalleModel) into a dalle checkpoint directory that
dalle-generate and the C++ API (dalle::models::load_trained_prior) load. Run it once;
dalle itself never downloads anything.

Needs only torch and safetensors (the project's venv, ~/.cache/dalle/venv):
    ~/.cache/dalle/venv/bin/python scripts/export_rudalle_prior.py \\
        --weights pytorch_model_v3.bin --out checkpoints/rudalle-malevich

The tensors keep ruDALL-E's names; the loader renames them (dalle::models::
import_rudalle_state, docs/prior.md lists the names). fp16 weights are widened to fp32;
the three mask buffers (transformer.row_mask, ...) are dropped because the model rebuilds
its masks from the config. The sizes written to config.yaml come from the shapes: width
and the text vocabulary (its rows less the text_length position-unique padding ids) from
text_embeddings, text_length from text_pos_embeddings (which has one spare row), the grid
from image_row_embeddings, the layers from their indices. The head count is not in the
shapes: width 2048 (Malevich, Emojich, Surrealist) has 16 heads, width 3840 (Kandinsky)
60; other widths need --heads. ruDALL-E v3 models clip the conv mask at the grid's edges,
v2 models (Malevich_v2) wrap it around them (--conv-edges wrap).

The output directory holds config.yaml (`kind: prior` and the `model` keys of
PriorConfig, with ruDALL-E's layer rule, sandwich norms, head norm and tanh GELU),
model.safetensors and an empty state.safetensors, the layout of every dalle checkpoint.
"""
import argparse
import os
import pathlib
import re
import shutil
import tempfile

import torch
from safetensors.torch import save_file

HEADS_OF_WIDTH = {2048: 16, 3840: 60}


def load_state_dict(path):
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict) or "text_embeddings.weight" not in state:
        raise SystemExit(f"{path}: no text_embeddings.weight; not a ruDALL-E transformer state dict")
    for name in ("text_pos_embeddings.weight", "image_embeddings.weight", "image_row_embeddings.weight",
                 "transformer.layers.0.attention.query_key_value.weight"):
        if name not in state:
            raise SystemExit(f"{path}: missing tensor {name}: not a ruDALL-E transformer state dict")
    return state


def sizes(state, heads, conv_edges):
    width = state["text_embeddings.weight"].shape[1]
    text_length = state["text_pos_embeddings.weight"].shape[0] - 1
    layers = {int(m.group(1)) for name in state if (m := re.match(r"transformer\.layers\.(\d+)\.", name))}
    if layers != set(range(len(layers))):
        raise SystemExit(f"layer indices are not 0..{len(layers) - 1}: {sorted(layers)}")
    heads = heads or HEADS_OF_WIDTH.get(width)
    if not heads:
        raise SystemExit(f"width {width} is not a released ruDALL-E layout: give its head count with --heads")
    if width % heads:
        raise SystemExit(f"--heads {heads} does not divide the width {width}")
    return {
        "text_length": text_length,
        "text_vocab_size": state["text_embeddings.weight"].shape[0] - text_length,
        "grid_size": state["image_row_embeddings.weight"].shape[0],
        "image_vocab_size": state["image_embeddings.weight"].shape[0],
        "layers": len(layers),
        "width": width,
        "heads": heads,
        "layer_pattern": "rudalle",
        "conv_kernel": 11,
        "conv_edges": conv_edges,
        "sandwich_norm": "true",
        "head_norm": "true",
        "gelu": "tanh",
        "dropout": 0.1,
    }


def write_checkpoint(out, tensors, config, source):
    """Writes the directory beside its final place, then renames it there."""
    out = pathlib.Path(out)
    if out.exists():
        raise SystemExit(f"{out} exists; choose a new directory (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"source": source})
        save_file({}, str(staging / "state.safetensors"))
        lines = ["kind: prior", "model:"] + [f"  {key}: {value}" for key, value in config.items()]
        (staging / "config.yaml").write_text("\n".join(lines) + "\n")
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, help="ruDALL-E state dict (pytorch_model_v3.bin, .pt)")
    parser.add_argument("--out", required=True, help="checkpoint directory to create (must not exist)")
    parser.add_argument("--heads", type=int, default=0, help="attention heads (default: from the width)")
    parser.add_argument("--conv-edges", choices=("clamped", "wrap"), default="clamped",
                        help="clamped for v3 models (Malevich), wrap for v2 (default: clamped)")
    args = parser.parse_args()

    state = load_state_dict(args.weights)
    tensors = {name: tensor.float().contiguous() for name, tensor in state.items()
               if not (name.startswith("transformer.") and name.endswith("_mask"))}
    config = sizes(tensors, args.heads, args.conv_edges)
    write_checkpoint(args.out, tensors, config, f"ruDALL-E transformer {args.weights}")
    print(f"wrote {args.out}: {config['layers']} layers of width {config['width']} ({config['heads']} heads), "
          f"{sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
