#!/usr/bin/env python3
"""Converts OpenAI's released dVAE (encoder.pkl, decoder.pkl from the DALL-E repository)
into a dalle checkpoint directory that dalle-encode-images and the C++ API load by name.

Run once, with the `dall-e` package importable (the pickles are whole Python modules):
    python3 -m venv refs && refs/bin/pip install --no-deps dall-e==0.1 attrs requests \\
        urllib3 idna certifi charset-normalizer torch safetensors
    refs/bin/python scripts/export_openai_dvae.py --encoder encoder.pkl --decoder decoder.pkl \\
        --out checkpoints/openai-dvae

The released pickles fail in forward() on torch >= 1.11 (an Upsample attribute), but
only their weights are read here. The output directory holds config.yaml (the model's
sizes, read from the modules), model.safetensors (encoder.* and decoder.* tensors named
as in the release: encoder.blocks.group_1.block_1.res_path.conv_1.w ...) and an empty
state.safetensors.
"""
import argparse
import pathlib

import torch
from safetensors.torch import save_file


def load_module(path):
    module = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(module, dict):
        raise SystemExit(f"{path}: holds a state dict, expected the pickled dall_e module")
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", required=True, help="encoder.pkl")
    parser.add_argument("--decoder", required=True, help="decoder.pkl")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    parser.add_argument("--image-size", type=int, default=256, help="image side the model tokenizes")
    args = parser.parse_args()

    encoder, decoder = load_module(args.encoder), load_module(args.decoder)
    if encoder.vocab_size != decoder.vocab_size or encoder.n_hid != decoder.n_hid:
        raise SystemExit("the encoder and decoder come from different models")
    tensors = {f"encoder.{k}": v.float().contiguous() for k, v in encoder.state_dict().items()}
    tensors |= {f"decoder.{k}": v.float().contiguous() for k, v in decoder.state_dict().items()}

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"source": "OpenAI dall_e release"})
    save_file({}, str(out / "state.safetensors"))
    (out / "config.yaml").write_text(
        "model:\n"
        f"  input_channels: {encoder.input_channels}\n"
        f"  hidden: {encoder.n_hid}\n"
        f"  decoder_init: {decoder.n_init}\n"
        f"  groups: {encoder.group_count}\n"
        f"  blocks_per_group: {encoder.n_blk_per_group}\n"
        f"  downsamplings: {encoder.group_count - 1}\n"
        f"  vocab_size: {encoder.vocab_size}\n"
        "data:\n"
        f"  image_size: {args.image_size}\n")
    print(f"wrote {out}: {len(tensors)} tensors, "
          f"{sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
