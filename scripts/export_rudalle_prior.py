#!/usr/bin/env python3
"""Exports ruDALL-E's transformer weights (the `pytorch_model.bin` state dict of
Malevich/Kandinsky, or any `rudalle` DalleModel) to safetensors under ruDALL-E's own
names, for `dalle::models::import_rudalle_state` (docs/prior.md lists the renaming).

Run once, with torch and safetensors installed (the `rudalle` package is not needed):
    python3 scripts/export_rudalle_prior.py --weights pytorch_model.bin --out rudalle-xl.safetensors

fp16 weights are widened to fp32; the three mask buffers (transformer.row_mask, ...) are
dropped because the C++ model rebuilds its masks from the config.
"""
import argparse

import torch
from safetensors.torch import save_file


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, help="ruDALL-E state dict (.bin / .pt)")
    parser.add_argument("--out", required=True, help="safetensors file to write")
    args = parser.parse_args()

    state = torch.load(args.weights, map_location="cpu", weights_only=True)
    if "state_dict" in state:
        state = state["state_dict"]
    tensors = {
        name: tensor.float().contiguous()
        for name, tensor in state.items()
        if not (name.startswith("transformer.") and name.endswith("_mask"))
    }
    if "text_embeddings.weight" not in tensors:
        raise SystemExit(f"{args.weights}: no text_embeddings.weight; not a ruDALL-E transformer state dict")
    save_file(tensors, args.out, metadata={"source": "ruDALL-E transformer"})
    layers = 1 + max(int(name.split(".")[2]) for name in tensors if name.startswith("transformer.layers."))
    width = tensors["text_embeddings.weight"].shape[1]
    print(f"{args.out}: {len(tensors)} tensors, {layers} layers, width {width}")


if __name__ == "__main__":
    main()
