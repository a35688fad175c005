#!/usr/bin/env python3
"""Converts a released Real-ESRGAN generator (RealESRGAN_x4plus.pth, RealESRGAN_x2plus.pth,
RealESRNet_x4plus.pth, ... from xinntao/Real-ESRGAN, or ruDALL-E's RealESRGAN_x2.pth,
RealESRGAN_x4.pth, RealESRGAN_x8.pth from shonenkov/rudalle-utils) into a dalle checkpoint
directory that the C++ API (dalle::train::load_trained_rrdbnet, then
dalle::models::super_resolve) loads by name. Run it once; dalle itself never downloads
anything.

Needs only torch and safetensors (e.g. the project's venv, ~/.cache/dalle/venv):
    ~/.cache/dalle/venv/bin/python scripts/export_realesrgan.py \\
        --pth RealESRGAN_x4plus.pth --out checkpoints/realesrgan-x4plus

The file holds basicsr's RRDBNet state dict, under `params_ema` (the weights' moving
average, what Real-ESRGAN's inference uses), `params`, or at the top level (ruDALL-E's
files). `params_ema` is taken when present (`--key params` picks the other). The name
mapping is the identity: conv_first, body.N.rdb{1,2,3}.conv{1..5}, conv_body, conv_up1,
conv_up2, conv_up3 (x8 only), conv_hr, conv_last are ours. The sizes written to
config.yaml are read from the shapes: num_feat from conv_first, num_block from the body
indices, num_grow_ch from body.0.rdb1.conv1, num_out_ch from conv_last; the scale is 8
when conv_up3 exists, otherwise conv_first's input channels are num_in_ch times 16 (x1),
4 (x2) or 1 (x4), with num_in_ch 3 unless --in-channels says otherwise. Real-ESRGAN's
SRVGGNetCompact models (realesr-animevideov3, realesr-general-x4v3) are another network
and are refused, as are ESRGAN's old-layout files (RRDB_trunk.*, model.N.*).

The output directory holds config.yaml (`kind: rrdbnet` and the `model` sizes, the keys of
RrdbNetConfig), model.safetensors (fp32) and an empty state.safetensors, the layout of
every dalle checkpoint (include/dalle/io/checkpoint.h).
"""
import argparse
import pathlib
import re

import torch
from safetensors.torch import save_file


def load_state_dict(path, key):
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise SystemExit(f"{path}: not a plain tensor file ({type(error).__name__}: {error})")
    if not isinstance(checkpoint, dict):
        raise SystemExit(f"{path}: expected a dict of tensors, found {type(checkpoint).__name__}")
    if key is not None:
        if key not in checkpoint:
            raise SystemExit(f"{path}: no '{key}' entry (it has {', '.join(sorted(checkpoint)[:5])})")
        return checkpoint[key], key
    for candidate in ("params_ema", "params"):
        if candidate in checkpoint:
            return checkpoint[candidate], candidate
    return checkpoint, "top level"


def check_layout(path, state):
    if not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SystemExit(f"{path}: the state dict holds entries that are not tensors")
    if "conv_first.weight" not in state:
        if "body.0.weight" in state:
            raise SystemExit(f"{path}: an SRVGGNetCompact model (body.0.weight), not RRDBNet; not supported")
        if any(k.startswith(("RRDB_trunk.", "model.")) for k in state):
            raise SystemExit(f"{path}: ESRGAN's old layout (RRDB_trunk.* / model.N.*); convert it to basicsr's "
                             "names first (basicsr's scripts/model_conversion)")
        raise SystemExit(f"{path}: missing tensor conv_first.weight: not a basicsr RRDBNet state dict")
    for name in ("body.0.rdb1.conv1.weight", "conv_body.weight", "conv_up1.weight", "conv_up2.weight",
                 "conv_hr.weight", "conv_last.weight"):
        if name not in state:
            raise SystemExit(f"{path}: missing tensor {name}: not a basicsr RRDBNet state dict")


def sizes(state, in_channels):
    first_in = state["conv_first.weight"].shape[1]
    if "conv_up3.weight" in state:
        scale = 8
        if first_in != in_channels:
            raise SystemExit(f"x8 model: conv_first reads {first_in} channels, expected {in_channels}")
    else:
        by_factor = {in_channels * 16: 1, in_channels * 4: 2, in_channels: 4}
        if first_in not in by_factor:
            raise SystemExit(f"conv_first reads {first_in} channels: not {in_channels} (x4), {in_channels * 4} (x2) "
                             f"or {in_channels * 16} (x1); set --in-channels")
        scale = by_factor[first_in]
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"body\.(\d+)\.", k))}
    if blocks != set(range(len(blocks))):
        raise SystemExit(f"body block indices are not 0..{len(blocks) - 1}: {sorted(blocks)}")
    return {
        "num_in_ch": in_channels,
        "num_out_ch": state["conv_last.weight"].shape[0],
        "scale": scale,
        "num_feat": state["conv_first.weight"].shape[0],
        "num_block": len(blocks),
        "num_grow_ch": state["body.0.rdb1.conv1.weight"].shape[0],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pth", required=True, help="RealESRGAN_x4plus.pth, RealESRGAN_x2.pth, ...")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    parser.add_argument("--key", choices=("params_ema", "params"), default=None,
                        help="which state dict of the file (default: params_ema, else params, else the top level)")
    parser.add_argument("--in-channels", type=int, default=3, help="image channels the model reads (3)")
    args = parser.parse_args()

    state, source = load_state_dict(args.pth, args.key)
    check_layout(args.pth, state)
    config = sizes(state, args.in_channels)
    model = {k: v.float().contiguous() for k, v in state.items()}

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(model, str(out / "model.safetensors"), metadata={"source": f"Real-ESRGAN {args.pth} ({source})"})
    save_file({}, str(out / "state.safetensors"))
    lines = ["kind: rrdbnet", "model:"] + [f"  {k}: {v}" for k, v in config.items()]
    (out / "config.yaml").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: x{config['scale']}, {len(model)} tensors from {source}, "
          f"{sum(t.numel() for t in model.values()) / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
