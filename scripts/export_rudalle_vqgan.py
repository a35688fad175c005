#!/usr/bin/env python3
"""Converts ruDALL-E's released VQGAN (vqgan.gumbelf8-sber.model.ckpt, the file rudalle's
get_vae() downloads) into a dalle checkpoint directory that dalle-encode-images and the
C++ API (dalle::train::load_image_tokenizer) load by name. Run it once; dalle itself
never downloads anything.

Needs only torch and safetensors (e.g. the project's venv, ~/.cache/dalle/venv):
    ~/.cache/dalle/venv/bin/python scripts/export_rudalle_vqgan.py \\
        --ckpt vqgan.gumbelf8-sber.model.ckpt --out checkpoints/rudalle-vqgan
    dalle-encode-images --vqgan checkpoints/rudalle-vqgan --dataset data/train \\
        --tokenizer tok.model --out data/train-tokens

The name mapping is the identity: the checkpoint's `state_dict` holds GumbelVQ's own
names (encoder.down.0.block.0.norm1.weight, quantize.embed.weight, post_quant_conv.bias,
decoder.up.3.upsample.conv.weight, ...), which are ours. Tensors outside the model
(taming's `loss.*`: LPIPS and discriminator) are dropped, as rudalle's
load_state_dict(strict=False) ignores them. The sizes written to config.yaml are read
from the tensors' shapes; attention levels from which encoder levels have `attn` blocks.
The DWT variant (vqgan.gumbelf8-sber-dwt.model.ckpt) has another decoder and is refused.
"""
import argparse
import pathlib
import re

import torch
from safetensors.torch import save_file

MODEL_PREFIXES = ("encoder.", "decoder.", "quantize.", "quant_conv.", "post_quant_conv.")


def load_state_dict(path):
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a Lightning checkpoint may pickle its hyperparameters
        print(f"{path}: not loadable with weights_only=True ({type(error).__name__}); loading it in full, "
              "which runs pickled code: only do this with a file you trust")
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise SystemExit(f"{path}: expected a checkpoint with a 'state_dict' or a state dict")
    # rudalle's VQGanGumbelVAE wraps the model as `.model`; the DWT file is saved that way.
    if any(k.startswith("model.") for k in state) and not any(k.startswith("encoder.") for k in state):
        state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    if any(k.startswith("decoder.decoder.") or "idwt" in k for k in state):
        raise SystemExit(f"{path}: the DWT decoder variant is not supported; export the plain gumbelf8 model")
    return state


def count(state, pattern):
    return len({m.group(1) for k in state if (m := re.match(pattern, k))})


def sizes(state, resolution):
    for name in ("encoder.conv_in.weight", "encoder.conv_out.weight", "quant_conv.weight", "decoder.conv_out.weight"):
        if name not in state:
            raise SystemExit(f"missing tensor {name}: not a taming/ruDALL-E VQGAN state dict")
    ch = state["encoder.conv_in.weight"].shape[0]
    levels = count(state, r"encoder\.down\.(\d+)\.")
    ch_mult = [state[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch for i in range(levels)]
    attn = [resolution >> i for i in range(levels) if f"encoder.down.{i}.attn.0.q.weight" in state]
    gumbel = "quantize.proj.weight" in state
    codebook = state["quantize.embed.weight" if gumbel else "quantize.embedding.weight"]
    return {
        "in_channels": state["encoder.conv_in.weight"].shape[1],
        "out_channels": state["decoder.conv_out.weight"].shape[0],
        "ch": ch,
        "ch_mult": ch_mult,
        "num_res_blocks": count(state, r"encoder\.down\.0\.block\.(\d+)\."),
        "attn_resolutions": attn,
        "z_channels": state["encoder.conv_out.weight"].shape[0],
        "embed_dim": state["quant_conv.weight"].shape[0],
        "n_embed": codebook.shape[0],
        "resolution": resolution,
        "norm_groups": 32,  # taming's Normalize; not recoverable from the shapes
        "quantizer": "gumbel" if gumbel else "vector",
    }


def yaml_value(value):
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def model_tensors(state):
    """The model's tensors of a taming state dict, in fp32, and the names of those dropped."""
    model = {k: v.float().contiguous() for k, v in state.items() if k.startswith(MODEL_PREFIXES)}
    return model, sorted(k for k in state if not k.startswith(MODEL_PREFIXES))


def write_checkpoint(out, model, config, image_size, source, dropped=()):
    """A checkpoint directory dalle::train::load_image_tokenizer reads: model.safetensors,
    an empty state.safetensors and config.yaml (`kind: vqgan`, `config` as its model section)."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(model, str(out / "model.safetensors"), metadata={"source": source})
    save_file({}, str(out / "state.safetensors"))
    lines = ["kind: vqgan", "model:"] + [f"  {k}: {yaml_value(v)}" for k, v in config.items()]
    lines += ["data:", f"  image_size: {image_size}"]
    (out / "config.yaml").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(model)} tensors, {sum(t.numel() for t in model.values()) / 1e6:.1f}M parameters"
          f"; dropped {len(dropped)} tensors outside the model"
          + (f" ({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''})" if dropped else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="vqgan.gumbelf8-sber.model.ckpt")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    parser.add_argument("--image-size", type=int, default=256,
                        help="image side the model was built for and tokenizes (ruDALL-E: 256)")
    args = parser.parse_args()

    model, dropped = model_tensors(load_state_dict(args.ckpt))
    write_checkpoint(args.out, model, sizes(model, args.image_size), args.image_size,
                     f"ruDALL-E VQGAN {args.ckpt}", dropped)


if __name__ == "__main__":
    main()
