#!/usr/bin/env python3
"""Converts a CLIP ViT model from open_clip or OpenAI into a dalle checkpoint directory
(config.yaml, model.safetensors, state.safetensors) that the C++ API
(dalle::train::load_trained_clip) loads by name. Run it once; dalle itself never
downloads anything.

Two sources:
  * an open_clip model, built by name with its pretrained tag or a weights file (needs the
    open_clip environment that tests/parity/make_clip_fixture.py describes, and network
    access or the file for the weights):
        ~/.cache/dalle/clip-venv/bin/python scripts/export_open_clip.py \\
            --model ViT-B-32 --pretrained openai --out checkpoints/clip-vit-b-32
  * a state dict file: OpenAI's released TorchScript archive (ViT-B-32.pt) or a torch.save'd
    open_clip state dict; needs only torch and safetensors (the project's venv):
        ~/.cache/dalle/venv/bin/python scripts/export_open_clip.py \\
            --state-dict ViT-B-32.pt --out checkpoints/clip-vit-b-32

The name mapping is the identity: open_clip's CLIP and OpenAI's CLIP name their tensors as
dalle's Clip does (visual.conv1.weight, visual.transformer.resblocks.N.attn.in_proj_weight,
token_embedding.weight, text_projection, logit_scale, ...; docs/clip.md). OpenAI's archive
also holds input_resolution, context_length and vocab_size, which are dropped. Tensors are
written as float32. Sizes are read from the shapes, as OpenAI's build_model does; head
counts are not in the shapes and default to width / 64 (every released ViT), or are read
from the open_clip model, or given with --vision-heads / --text-heads. The activation is
QuickGELU for OpenAI's weights (the `-quickgelu` open_clip models too) and GELU for the
others: from the open_clip model when it is built here, else --activation (quick_gelu by
default, as OpenAI's). Text pooling is `argmax`: CLIP's BPE gives the end of text the
largest id. ResNet image towers, Hugging Face text towers, layer scale, attentional pooling
and SigLIP's logit_bias are refused: their tensors have no place in dalle's model.
"""
import argparse
import pathlib
import re

import torch
from safetensors.torch import save_file

DROPPED = ("input_resolution", "context_length", "vocab_size", "attn_mask")


def count(state, pattern):
    return len({m.group(1) for k in state if (m := re.match(pattern, k))})


def block_names(prefix, layers):
    names = []
    for i in range(layers):
        block = f"{prefix}transformer.resblocks.{i}."
        for part in ("ln_1.weight", "ln_1.bias", "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
                     "attn.out_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                     "mlp.c_proj.weight", "mlp.c_proj.bias"):
            names.append(block + part)
    return names


def expected_names(config):
    names = ["visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre.weight",
             "visual.ln_pre.bias", "visual.ln_post.weight", "visual.ln_post.bias", "visual.proj",
             "token_embedding.weight", "positional_embedding", "ln_final.weight", "ln_final.bias", "text_projection",
             "logit_scale"]
    return set(names + block_names("visual.", config["vision_layers"]) + block_names("", config["text_layers"]))


def sizes(state, vision_heads=None, text_heads=None):
    for name in ("visual.conv1.weight", "visual.positional_embedding", "text_projection", "token_embedding.weight",
                 "ln_final.weight", "positional_embedding"):
        if name not in state:
            hint = " (a ResNet image tower?)" if any(k.startswith("visual.layer1.") for k in state) else ""
            raise SystemExit(f"missing tensor {name}: not a CLIP ViT state dict{hint}")
    vision_width, _, patch, _ = state["visual.conv1.weight"].shape
    tokens = state["visual.positional_embedding"].shape[0]
    grid = round((tokens - 1) ** 0.5)
    if grid * grid + 1 != tokens:
        raise SystemExit(f"visual.positional_embedding has {tokens} rows, not a square grid plus a class token")
    text_width = state["ln_final.weight"].shape[0]
    vision_mlp = state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    text_mlp = state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    if vision_mlp * text_width != text_mlp * vision_width:
        raise SystemExit(f"the towers' MLP ratios differ ({vision_mlp}/{vision_width} and {text_mlp}/{text_width}); "
                         "dalle's Clip has one mlp_ratio")
    return {
        "embed_dim": state["text_projection"].shape[1],
        "image_size": patch * grid,
        "patch_size": patch,
        "vision_width": vision_width,
        "vision_layers": count(state, r"visual\.transformer\.resblocks\.(\d+)\."),
        "vision_heads": vision_heads or vision_width // 64,
        "context_length": state["positional_embedding"].shape[0],
        "vocab_size": state["token_embedding.weight"].shape[0],
        "text_width": text_width,
        "text_layers": count(state, r"transformer\.resblocks\.(\d+)\."),
        "text_heads": text_heads or text_width // 64,
        "mlp_ratio": vision_mlp / vision_width,
    }


def from_file(path):
    try:
        return torch.jit.load(path, map_location="cpu").state_dict()  # OpenAI's released archives
    except RuntimeError:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise SystemExit(f"{path}: expected a TorchScript CLIP archive or a state dict")
        # open_clip's training checkpoints prefix every name with the DDP wrapper's "module.".
        if all(k.startswith("module.") for k in state):
            state = {k[len("module."):]: v for k, v in state.items()}
        return state


def from_open_clip(name, pretrained):
    import open_clip  # only this source needs it

    model = open_clip.create_model(name, pretrained=pretrained, device="cpu")
    if not isinstance(model, open_clip.model.CLIP):
        raise SystemExit(f"{name}: an open_clip {type(model).__name__}, not a CLIP with a ViT and a text transformer")
    if getattr(model, "text_pool_type", "argmax") != "argmax":
        raise SystemExit(f"{name}: text pooling '{model.text_pool_type}'; only argmax is exported")
    mlp = model.visual.transformer.resblocks[0].mlp
    activation = "quick_gelu" if isinstance(mlp.gelu, open_clip.transformer.QuickGELU) else "gelu"
    if not isinstance(mlp.gelu, (open_clip.transformer.QuickGELU, torch.nn.GELU)):
        raise SystemExit(f"{name}: activation {type(mlp.gelu).__name__} is neither GELU nor QuickGELU")
    heads = (model.visual.transformer.resblocks[0].attn.num_heads, model.transformer.resblocks[0].attn.num_heads)
    return model.state_dict(), activation, heads


def yaml_value(value):
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    return repr(float(value)) if isinstance(value, float) else str(value)


def checked_tensors(state, config, where):
    """`state` as float32 tensors, refused unless its names are exactly those of dalle's Clip
    at `config`'s sizes."""
    expected = expected_names(config)
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise SystemExit(f"{where}: does not fit dalle's Clip; missing {missing[:5]}, unexpected {unexpected[:5]}")
    return {k: v.detach().float().contiguous() for k, v in state.items()}


def write_checkpoint(out, tensors, config, where):
    """A checkpoint directory dalle::models::load_trained_clip reads: config.yaml (kind clip and
    the `model` keys of `config`), model.safetensors and an empty state.safetensors."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"source": str(where)})
    save_file({}, str(out / "state.safetensors"))
    lines = ["kind: clip", "model:"] + [f"  {k}: {yaml_value(v)}" for k, v in config.items()]
    (out / "config.yaml").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(tensors)} tensors, {sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters, "
          f"{config['activation']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="open_clip model name, e.g. ViT-B-32 or ViT-B-32-quickgelu")
    source.add_argument("--state-dict", help="OpenAI's TorchScript archive or a torch.save'd state dict")
    parser.add_argument("--pretrained", help="with --model: open_clip's pretrained tag (openai, laion2b_s34b_b79k) "
                                             "or a weights file")
    parser.add_argument("--activation", choices=("quick_gelu", "gelu"), default="quick_gelu",
                        help="with --state-dict: the MLP activation the weights were trained with "
                             "(OpenAI: quick_gelu)")
    parser.add_argument("--vision-heads", type=int, help="with --state-dict: default vision width / 64")
    parser.add_argument("--text-heads", type=int, help="with --state-dict: default text width / 64")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    args = parser.parse_args()

    if args.model:
        state, activation, (vision_heads, text_heads) = from_open_clip(args.model, args.pretrained)
        where = f"open_clip {args.model} ({args.pretrained or 'random weights'})"
    else:
        state, activation = from_file(args.state_dict), args.activation
        vision_heads, text_heads = args.vision_heads, args.text_heads
        where = args.state_dict
    if "logit_bias" in state:
        raise SystemExit("logit_bias: a SigLIP-style model, which dalle's Clip does not have")
    state = {k: v for k, v in state.items() if k not in DROPPED}
    config = sizes(state, vision_heads, text_heads)
    config |= {"activation": activation, "text_pooling": "argmax"}
    write_checkpoint(args.out, checked_tensors(state, config, where), config, where)


if __name__ == "__main__":
    main()
