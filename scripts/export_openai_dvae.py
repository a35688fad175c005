#!/usr/bin/env python3
"""Converts OpenAI's released dVAE (encoder.pkl, decoder.pkl from the DALL-E repository)
into a dalle checkpoint directory that dalle-encode-images and the C++ API load by name.
`scripts/import-model dvae` runs it; it can also run alone:
    ~/.cache/dalle/venv/bin/python scripts/export_openai_dvae.py --encoder encoder.pkl \
        --decoder decoder.pkl --out checkpoints/openai-dvae

The pickles are whole Python modules of the `dall-e` package, but only their weights and
sizes are read: the package's classes are replaced by plain torch modules while unpickling,
so neither `dall-e` nor its dependencies need to be installed (and the released modules'
forward(), which fails on torch >= 1.11, is never called). The output directory holds
config.yaml (the model's sizes, read from the modules), model.safetensors (encoder.* and
decoder.* tensors named as in the release: encoder.blocks.group_1.block_1.res_path.conv_1.w
...) and an empty state.safetensors.
"""
import argparse
import pathlib
import pickle
import types

import torch
from safetensors.torch import save_file


class ReleaseUnpickler(pickle.Unpickler):
    """Unpickles dall_e's modules as plain torch modules of the same names: their parameters,
    submodules and attributes (the sizes) come back; their code is not needed."""
    stand_ins = {}

    def find_class(self, module, name):
        if module == "dall_e" or module.startswith("dall_e."):
            key = (module, name)
            if key not in self.stand_ins:
                self.stand_ins[key] = type(name, (torch.nn.Module,), {"__module__": module})
            return self.stand_ins[key]
        return super().find_class(module, name)


RELEASE_PICKLE = types.SimpleNamespace(__name__="release_pickle", Unpickler=ReleaseUnpickler,
                                       load=lambda file, **kw: ReleaseUnpickler(file, **kw).load())


def load_module(path):
    module = torch.load(path, map_location="cpu", weights_only=False, pickle_module=RELEASE_PICKLE)
    if isinstance(module, dict):
        raise SystemExit(f"{path}: holds a state dict, expected the pickled dall_e module")
    missing = [size for size in ("vocab_size", "n_hid") if not hasattr(module, size)]
    if not isinstance(module, torch.nn.Module) or missing:
        raise SystemExit(f"{path}: not a dall_e Encoder or Decoder (no {', '.join(missing) or 'module'})")
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
