#!/usr/bin/env python3
"""Exports min-dalle's released DALL-E Mega / Mini files to dalle checkpoint directories.

    python scripts/export_mindalle.py prior --encoder encoder.pt --decoder decoder.pt --out DIR
    python scripts/export_mindalle.py detokenizer --weights detoker.pt --out DIR

`prior` writes kind bart_prior: the encoder's and decoder's tensors under `encoder.` and
`decoder.`, as min-dalle names them (docs/mega-prior.md), and the sizes read from their shapes
(the heads are not in the shapes: Mega's 32 and Mini's 16 are known by width, others need
--heads). min-dalle's files lack the gains of the LayerNorms that feed a Linear; the loader
takes them as ones, as min-dalle's strict=False load does. `detokenizer` writes kind
vqgan_detokenizer: min-dalle's VQGanDetokenizer (taming's decoder without an encoder), its
sizes read from the shapes. Tensors are stored as float32, or as --dtype says.

Needs only torch and safetensors (the project's venv, ~/.cache/dalle/venv). The files are
read with torch.load(weights_only=True): no pickled code runs.
"""
import argparse
import pathlib
import re

import torch
from safetensors.torch import save_file

HEADS_BY_WIDTH = {2048: 32, 1024: 16}  # Mega, Mini (min-dalle's MinDalle.__init__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(path, what):
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise SystemExit(f"{path}: not a loadable {what} state dict ({type(error).__name__}: {error})")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SystemExit(f"{path}: expected a state dict of tensors ({what})")
    return state


def require(state, names, path, what):
    missing = [name for name in names if name not in state]
    if missing:
        raise SystemExit(f"{path}: not min-dalle's {what}; it lacks {', '.join(missing)}")


def count(state, pattern):
    return len({m.group(1) for k in state if (m := re.match(pattern, k))})


def yaml_value(value):
    return "[" + ", ".join(str(v) for v in value) + "]" if isinstance(value, list) else str(value)


def write_checkpoint(out, kind, config, tensors, source, extra=()):
    out.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(out / "model.safetensors"), metadata={"source": source})
    save_file({}, str(out / "state.safetensors"))
    lines = [f"kind: {kind}", "model:"] + [f"  {k}: {yaml_value(v)}" for k, v in config.items()] + list(extra)
    (out / "config.yaml").write_text("\n".join(lines) + "\n")
    parameters = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {len(tensors)} tensors, {parameters / 1e6:.1f}M parameters")


def prior_sizes(encoder, decoder, args):
    require(encoder, ["embed_tokens.weight", "embed_positions.weight", "layers.0.glu.fc0.weight"], args.encoder,
            "encoder")
    require(decoder, ["embed_tokens.weight", "embed_positions.weight", "lm_head.weight"], args.decoder, "decoder")
    text_vocab, width = encoder["embed_tokens.weight"].shape
    layers, decoder_layers = count(encoder, r"layers\.(\d+)\."), count(decoder, r"layers\.(\d+)\.")
    if decoder_layers != layers:
        raise SystemExit(f"{args.decoder}: {decoder_layers} layers, the encoder {layers}")
    heads = args.heads or HEADS_BY_WIDTH.get(width)
    if not heads:
        raise SystemExit(f"width {width} is neither Mega's nor Mini's: give --heads")
    image_vocab = decoder["embed_tokens.weight"].shape[0] - 1
    if args.codes > image_vocab + 1:
        raise SystemExit(f"--codes {args.codes} exceeds the decoder's {image_vocab + 1} image token ids")
    return {"layers": layers, "heads": heads, "width": width,
            "glu_width": encoder["layers.0.glu.fc0.weight"].shape[0], "text_vocab_size": text_vocab,
            "text_length": encoder["embed_positions.weight"].shape[0], "image_vocab_size": image_vocab,
            "image_length": decoder["embed_positions.weight"].shape[0], "codes": args.codes}


def export_prior(args):
    encoder, decoder = load(args.encoder, "encoder"), load(args.decoder, "decoder")
    config = prior_sizes(encoder, decoder, args)
    dtype = DTYPES[args.dtype]
    tensors = {f"{part}.{name}": tensor.to(dtype).contiguous()
               for part, state in (("encoder", encoder), ("decoder", decoder)) for name, tensor in state.items()}
    write_checkpoint(pathlib.Path(args.out), "bart_prior", config, tensors,
                     f"min-dalle {args.encoder} + {args.decoder}")


def detokenizer_sizes(state, args):
    require(state, ["embedding.weight", "post_quant_conv.weight", "decoder.conv_in.weight", "decoder.conv_out.weight"],
            args.weights, "VQGAN detokenizer")
    out_channels, ch = state["decoder.conv_out.weight"].shape[:2]
    levels = count(state, r"decoder\.up\.(\d+)\.")
    n_embed, embed_dim = state["embedding.weight"].shape
    return {"out_channels": out_channels, "ch": ch,
            "ch_mult": [state[f"decoder.up.{i}.block.0.conv1.weight"].shape[0] // ch for i in range(levels)],
            "num_res_blocks": count(state, r"decoder\.up\.0\.block\.(\d+)\.") - 1,
            "attn_resolutions": [args.image_size >> i for i in range(levels) if f"decoder.up.{i}.attn.0.q.weight" in state],
            "z_channels": state["post_quant_conv.weight"].shape[0], "embed_dim": embed_dim, "n_embed": n_embed,
            "resolution": args.image_size, "norm_groups": args.norm_groups, "quantizer": "vector"}


def export_detokenizer(args):
    state = load(args.weights, "VQGAN detokenizer")
    config = detokenizer_sizes(state, args)
    tensors = {name: tensor.float().contiguous() for name, tensor in state.items()}
    write_checkpoint(pathlib.Path(args.out), "vqgan_detokenizer", config, tensors, f"min-dalle {args.weights}",
                     ["data:", f"  image_size: {args.image_size}"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    prior = parts.add_parser("prior", help="encoder.pt + decoder.pt -> a bart_prior checkpoint")
    prior.add_argument("--encoder", required=True, help="min-dalle's encoder.pt (encoder_mini.pt for Mini)")
    prior.add_argument("--decoder", required=True, help="min-dalle's decoder.pt (decoder_mini.pt for Mini)")
    prior.add_argument("--out", required=True, help="checkpoint directory to create (must not exist)")
    prior.add_argument("--heads", type=int, default=0, help="attention heads (default: Mega's or Mini's by width)")
    prior.add_argument("--codes", type=int, default=16384, help="the detokenizer's codes (min-dalle: 16384)")
    prior.add_argument("--dtype", choices=DTYPES, default="float32", help="the stored tensors' type")
    detokenizer = parts.add_parser("detokenizer", help="detoker.pt -> a vqgan_detokenizer checkpoint")
    detokenizer.add_argument("--weights", required=True, help="min-dalle's vqgan/detoker.pt")
    detokenizer.add_argument("--out", required=True, help="checkpoint directory to create (must not exist)")
    detokenizer.add_argument("--image-size", type=int, default=256, help="image side of 16 x 16 tokens (256)")
    detokenizer.add_argument("--norm-groups", type=int, default=32,
                             help="GroupNorm groups (min-dalle: 32; not in the shapes)")
    args = parser.parse_args()
    (export_prior if args.part == "prior" else export_detokenizer)(args)


if __name__ == "__main__":
    main()
