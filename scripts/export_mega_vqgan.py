#!/usr/bin/env python3
"""Converts the VQGAN behind DALL-E Mega's and Mini's image tokens (16384 codes, 16x16 tokens
for 256-pixel images) into a dalle checkpoint directory whose encoder makes those tokens:
dalle-encode-images (fine-tuning Mega on one's own images) and the C++ API
(dalle::train::load_image_tokenizer). Run it once; dalle itself never downloads anything.

Needs only torch, safetensors, numpy and msgpack (the project's venv, ~/.cache/dalle/venv;
scripts/setup installs msgpack there):
    ~/.cache/dalle/venv/bin/python scripts/export_mega_vqgan.py \\
        --vqgan flax_model.msgpack --out checkpoints/mega-vqgan
    dalle-encode-images --vqgan checkpoints/mega-vqgan --dataset data/train \\
        --tokenizer tok.model --out data/train-tokens
scripts/import-model mega --vqgan FILE runs it into a model folder's encoder/.

Either source:
  flax_model.msgpack  dalle-mini's Flax weights (the hub folder dalle-mini/vqgan_imagenet_f16_16384
                      that vqgan-jax's VQModel.from_pretrained reads), read with msgpack alone:
                      neither jax nor flax is needed, and no code in the file runs. flax.serialization
                      writes a tree of maps whose arrays are msgpack extension type 1 holding
                      (shape, dtype name, C-order bytes); arrays over 2^30 bytes are split into
                      {"__msgpack_chunked_array__", shape, chunks} maps.
  last.ckpt           taming-transformers' vqgan_imagenet_f16_16384 checkpoint, from which dalle-mini's
                      was converted: a Lightning checkpoint whose `state_dict` holds VQModel's names,
                      which are ours (scripts/export_rudalle_vqgan.py). One that pickles objects of
                      classes not importable here (pytorch_lightning's callbacks) is read with every
                      class but the tensors' replaced by an inert placeholder: no pickled code runs.
The format is told by the file's suffix (.msgpack: Flax), or --format.

Flax names are vqgan-jax's: a list of submodules is `name_i` (encoder.down_0.block_1.norm1) where
taming has `name.i` (encoder.down.0.block.1.norm1), except mid's own block_1, attn_1 and block_2;
conv `kernel`s are [kh, kw, in, out] (HWIO) where torch's weights are [out, in, kh, kw]; GroupNorm
`scale` is taming's weight; the codebook is quantize.embedding.embedding. The tensors are checked
against taming's layout by name, and the sizes written to config.yaml are read from their shapes
(scripts/export_rudalle_vqgan.py's sizes()). Only the vector quantizer (taming's VQModel) is taken:
ruDALL-E's gumbel VQGAN goes through export_rudalle_vqgan.py.

Pixel range (config.yaml's model.pixel_range): dalle-mini encodes images in [0, 1] as they are
(tools/dataset/encode_dataset.ipynb: webdataset's "rgb" decoding straight into VQModel.encode) and
clips the decoder's output to [0, 1] (tools/inference: decoded_images.clip(0.0, 1.0)), as min-dalle
does; so --pixel-range zero_to_one is the default, the tokens DALL-E Mega was trained on. taming
itself trains on [-1, 1] (taming/data/base.py: image / 127.5 - 1): minus_one_to_one is that range.

Attention order (config.yaml's model.level_attention): dalle-mini encoded its training images with
patil-suraj/vqgan-jax, whose DownsamplingBlock ran every attention block of a level after each
residual block (block 0, attn 0, attn 1, block 1, attn 0, attn 1 at the 16x16 level) from its first
commit (2021-06-28) until its pull request 10 ("fix: encoder/decoder attention", commit caafeee,
2022-07-09) made it taming's block i, attn i. DALL-E Mega was trained on tokens encoded before that
(its training ran from about April to June 2022; dalle-mini's training reads the tokens its
encoding notebook wrote beforehand), so --level-attention vqgan_jax_2021 is the default: the
tokens Mega learnt, for image prompts and for fine-tuning data alike. taming is the order the
weights were trained in (taming-transformers, in PyTorch), whose codes reconstruct images best
(docs/generate.md weighs the two).
"""
import argparse
import pathlib
import pickle
import re
import sys

import msgpack
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import export_rudalle_vqgan as taming  # noqa: E402  (the taming-layout helpers this script shares)

FLAX_NDARRAY, FLAX_NPSCALAR = 1, 3  # flax.serialization's msgpack extension types
FLAX_LIST_ITEM = re.compile(r"(down|up|block|attn)_(\d+)")
FLAX_LEAVES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


# --- dalle-mini's Flax weights ---------------------------------------------------------------

def _ndarray(data):
    shape, dtype, buffer = msgpack.unpackb(data, raw=True)
    dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
    if dtype == "bfloat16":  # jax's own dtype, unknown to numpy
        array = torch.frombuffer(bytearray(buffer), dtype=torch.bfloat16).float().numpy()
    else:
        array = np.frombuffer(buffer, dtype=np.dtype(dtype))
    return array.reshape(shape)


def _ext_hook(code, data):
    if code == FLAX_NDARRAY:
        return _ndarray(data)
    if code == FLAX_NPSCALAR:
        return _ndarray(data)[()]
    raise SystemExit(f"msgpack extension type {code} is not one of flax.serialization's arrays")


def _unchunk(node):
    shape = tuple(node["shape"][str(i)] for i in range(len(node["shape"])))
    chunks = [node["chunks"][str(i)] for i in range(len(node["chunks"]))]
    return np.concatenate([np.asarray(c).reshape(-1) for c in chunks]).reshape(shape)


def read_flax_msgpack(path):
    """flax.serialization.msgpack_restore without flax: the file's tree, its arrays as numpy."""
    with open(path, "rb") as f:
        try:
            tree = msgpack.unpackb(f.read(), ext_hook=_ext_hook, raw=False, strict_map_key=False)
        except (msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException, ValueError) as error:
            raise SystemExit(f"{path}: not a msgpack file ({error})")
    if not isinstance(tree, dict):
        raise SystemExit(f"{path}: expected a tree of parameters, got a {type(tree).__name__}")
    if set(tree) == {"params"}:  # a variables collection rather than bare parameters
        tree = tree["params"]
    return tree


def _leaves(tree, path=()):
    for key, value in tree.items():
        here = path + (str(key),)
        if isinstance(value, dict) and value.get("__msgpack_chunked_array__"):
            yield here, _unchunk(value)
        elif isinstance(value, dict):
            yield from _leaves(value, here)
        else:
            yield here, value


def taming_name(path):
    """vqgan-jax's parameter path -> taming's state dict name."""
    parts = []
    for i, part in enumerate(path[:-1]):
        item = FLAX_LIST_ITEM.fullmatch(part)
        if item and (i == 0 or path[i - 1] != "mid"):
            parts += [item.group(1), item.group(2)]
        else:
            parts.append(part)
    if path[-1] not in FLAX_LEAVES:
        raise SystemExit(f"{'.'.join(path)}: unknown Flax parameter '{path[-1]}' "
                         f"(expected one of {', '.join(FLAX_LEAVES)})")
    return ".".join(parts + [FLAX_LEAVES[path[-1]]])


def taming_tensor(leaf, array):
    tensor = torch.from_numpy(np.array(array, dtype=np.float32))
    if leaf == "kernel" and tensor.dim() == 4:
        return tensor.permute(3, 2, 0, 1).contiguous()  # [kh, kw, in, out] -> [out, in, kh, kw]
    if leaf == "kernel" and tensor.dim() == 2:
        return tensor.t().contiguous()  # a Dense layer's [in, out] -> [out, in]
    if leaf in ("scale", "bias"):
        return tensor.reshape(-1)
    return tensor


def flax_state_dict(tree):
    """dalle-mini's Flax parameter tree -> taming's state dict."""
    state = {}
    for path, array in _leaves(tree):
        name = taming_name(path)
        if name in state:
            raise SystemExit(f"two Flax parameters map to {name}")
        state[name] = taming_tensor(path[-1], array)
    return state


# --- taming-transformers' checkpoint ----------------------------------------------------------

class _Inert:
    """What an unpickled object of a class that is not the tensors' becomes: nothing runs."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _allowed(module, name):
    if module == "collections" and name == "OrderedDict":
        return True
    if module == "torch._utils" and name.startswith("_rebuild_"):
        return True
    return module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return super().find_class(module, name) if _allowed(module, name) else _Inert


class _InertPickle:
    """A pickle module for torch.load whose unpickler resolves only what tensors need."""
    Unpickler = _InertUnpickler
    load = pickle.load
    __name__ = "inert_pickle"


def load_taming_checkpoint(path):
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # Lightning pickles its callbacks' classes, among others
        print(f"{path}: not loadable with weights_only=True ({type(error).__name__}); reading its tensors with "
              "every other pickled object replaced by an inert placeholder")
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_InertPickle)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SystemExit(f"{path}: expected a checkpoint with a 'state_dict' or a state dict of tensors")
    return state


# --- the checkpoint directory -----------------------------------------------------------------

def read_source(path, form):
    if form == "auto":
        form = "flax" if str(path).endswith(".msgpack") else "taming"
    if form == "flax":
        return flax_state_dict(read_flax_msgpack(path)), f"dalle-mini VQGAN (Flax) {path}"
    return load_taming_checkpoint(path), f"taming-transformers VQGAN {path}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vqgan", required=True,
                        help="dalle-mini's flax_model.msgpack or taming's last.ckpt (or a torch.save'd state dict)")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    parser.add_argument("--format", choices=("auto", "flax", "taming"), default="auto",
                        help="the source's format (auto: flax for a .msgpack file, taming otherwise)")
    parser.add_argument("--pixel-range", choices=("zero_to_one", "minus_one_to_one"), default="zero_to_one",
                        help="what the encoder reads: zero_to_one as dalle-mini encoded DALL-E Mega's images "
                             "(default), minus_one_to_one as taming trained it")
    parser.add_argument("--image-size", type=int, default=256,
                        help="image side the model was built for and tokenizes (DALL-E Mega: 256, 16x16 tokens)")
    parser.add_argument("--level-attention", choices=("vqgan_jax_2021", "taming"), default="vqgan_jax_2021",
                        help="the encoder's order of a level's attention blocks: vqgan_jax_2021 as dalle-mini "
                             "encoded DALL-E Mega's training images (default), or taming's own")
    args = parser.parse_args()

    state, source = read_source(args.vqgan, args.format)
    model, dropped = taming.model_tensors(state)
    if "quantize.embedding.weight" not in model:
        kind = "ruDALL-E's gumbel VQGAN: use scripts/export_rudalle_vqgan.py" if "quantize.embed.weight" in model \
            else "no codebook quantize.embedding.weight"
        raise SystemExit(f"{args.vqgan}: not a taming VQModel with a vector quantizer ({kind})")
    config = taming.sizes(model, args.image_size)
    config["pixel_range"] = args.pixel_range
    config["level_attention"] = args.level_attention
    taming.write_checkpoint(args.out, model, config, args.image_size, source, dropped)


if __name__ == "__main__":
    main()
