"""Parity fixture for Real-ESRGAN's generator: basicsr 1.4.2's
`basicsr.archs.rrdbnet_arch.RRDBNet` at scales 1, 2 and 4, and ruDALL-E 1.1.3's copy of it
with the third upsampling conv at scale 8 (`rudalle.realesrgan.rrdbnet_arch.RRDBNet`), each
with random weights at a small size (num_feat 8, num_block 2, num_grow_ch 4), saved with
input images and the reference outputs as tests/fixtures/rrdbnet_parity.safetensors. The
C++ test (tests/models/rrdbnet_test.cpp) loads every state dict by name and must
reproduce the outputs to 1e-4 relative error.

The references live in their own virtual environment; torch, numpy and safetensors come
from the project's venv through a .pth file:
    python3 -m venv ~/.cache/dalle/sr-venv
    ~/.cache/dalle/sr-venv/bin/pip install --no-deps basicsr==1.4.2 rudalle==1.1.3
    ~/.cache/dalle/venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \\
        > ~/.cache/dalle/sr-venv/lib/python3.11/site-packages/dalle-torch.pth
    ~/.cache/dalle/sr-venv/bin/python tests/parity/make_rrdbnet_fixture.py

(basicsr 1.4.2 comes as an sdist; pip builds its wheel, which takes a minute. Should that
fail, `pip download --no-deps --no-binary :all: basicsr==1.4.2` and unpack it: only
basicsr/archs/rrdbnet_arch.py and basicsr/archs/arch_util.py are read.)

`import basicsr` fails with torchvision >= 0.17 (basicsr/data imports the removed
torchvision.transforms.functional_tensor), and its archs package imports every arch
module. So `basicsr` and `basicsr.archs` are registered as bare packages, the two modules
arch_util.py imports at its top (basicsr.ops.dcn: deformable convs, basicsr.utils: a
logger; torchvision itself) are stubbed, and only rrdbnet_arch.py and arch_util.py run. The
same for `rudalle` (its __init__ needs huggingface_hub.cached_download): only
rudalle/realesrgan/{rrdbnet_arch,arch_util}.py run.

Weights are small integers times a power of two per tensor, stored as int8 beside that
scale (`x<S>.<name>` I8 and `x<S>.<name>:scale` F32): the reference computes with exactly
those values and the file stays small (about 0.3 MB).
"""
import importlib
import pathlib
import sys
import types

import torch
from safetensors.torch import save_file

SIZES = dict(num_in_ch=3, num_out_ch=3, num_feat=8, num_block=2, num_grow_ch=4)
# Input sizes per scale: not square, and at x1/x2 multiples of the unshuffle factor only.
INPUTS = {1: (2, 3, 12, 8), 2: (2, 3, 10, 14), 4: (2, 3, 9, 7), 8: (1, 3, 6, 5)}


def bare_package(name, directory):
    package = types.ModuleType(name)
    package.__path__ = [str(directory)]
    sys.modules[name] = package


def stub_module(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def find_site(relative):
    for entry in sys.path:
        if (pathlib.Path(entry) / relative).exists():
            return pathlib.Path(entry)
    raise SystemExit(f"{relative} is not importable: see this script's docstring for the environment")


def import_references():
    site = find_site("basicsr/archs/rrdbnet_arch.py")
    bare_package("basicsr", site / "basicsr")
    bare_package("basicsr.archs", site / "basicsr/archs")
    # What arch_util.py and rrdbnet_arch.py import besides torch; none of it is used here.
    stub_module("basicsr.ops", __path__=[])
    stub_module("basicsr.ops.dcn", ModulatedDeformConvPack=torch.nn.Module, modulated_deform_conv=None)
    registry = types.SimpleNamespace(register=lambda *a, **k: (lambda cls: cls))
    stub_module("basicsr.utils", get_root_logger=None, __path__=[])
    stub_module("basicsr.utils.registry", ARCH_REGISTRY=registry)
    if "torchvision" not in sys.modules:
        try:
            importlib.import_module("torchvision")
        except ImportError:
            stub_module("torchvision", __version__="0.0.0")
    basicsr = importlib.import_module("basicsr.archs.rrdbnet_arch")

    site = find_site("rudalle/realesrgan/rrdbnet_arch.py")
    bare_package("rudalle", site / "rudalle")
    bare_package("rudalle.realesrgan", site / "rudalle/realesrgan")
    rudalle = importlib.import_module("rudalle.realesrgan.rrdbnet_arch")
    return basicsr, rudalle


def quantized_randomize(module, generator):
    """Gives every parameter random values q * 2^-e with |q| <= 127, about N(0, 2/fan_in) for
    weights (a LeakyReLU net keeps its scale) and within +-0.125 for biases; returns q and e
    by name."""
    stored = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                e = 10
            else:
                fan_in = p[0].numel()
                # uniform +-127 has std 73; aim at std sqrt(2/fan_in)
                e = max(0, round(torch.log2(torch.tensor(73.0 * (fan_in / 2) ** 0.5)).item()))
            q = torch.randint(-127, 128, p.shape, generator=generator)
            p.copy_(q.float() * 2.0 ** -e)
            stored[name] = q.to(torch.int8)
            stored[name + ":scale"] = torch.tensor(2.0 ** -e, dtype=torch.float32)
    return stored


def body_share(model, x, out):
    """How much of the output the trunk (the RRDBs) decides: the relative change of the output
    when the trunk is skipped. A fixture where it is ~0 would not test the dense blocks."""
    saved = model.body
    model.body = torch.nn.Identity()
    try:
        without = model(x)
    finally:
        model.body = saved
    return ((out - without).abs().max() / out.abs().max()).item()


def main():
    basicsr, rudalle = import_references()
    generator = torch.Generator().manual_seed(0)
    tensors, metadata = {}, {k: str(v) for k, v in SIZES.items()}
    for scale, shape in INPUTS.items():
        arch = rudalle if scale == 8 else basicsr
        model = arch.RRDBNet(scale=scale, **SIZES).eval()
        weights = quantized_randomize(model, generator)
        x = torch.rand(shape, generator=generator)
        with torch.no_grad():
            out = model(x)
            share = body_share(model, x, out)
        assert out.shape == (shape[0], 3, shape[2] * scale, shape[3] * scale), out.shape
        assert share > 0.05, f"x{scale}: the trunk moves the output by only {share:.3g}"
        tensors |= {f"x{scale}.{k}": v for k, v in weights.items()}
        tensors |= {f"x{scale}.input": x, f"x{scale}.output": out}
        metadata[f"x{scale}.body_share"] = f"{share:.4f}"
        print(f"x{scale}: {len(weights) // 2} tensors, input {list(shape)}, output {list(out.shape)}, "
              f"output range [{out.min():.3f}, {out.max():.3f}], trunk share {share:.3f}")
    metadata["generator"] = (f"basicsr 1.4.2 RRDBNet (x1, x2, x4), rudalle 1.1.3 RRDBNet (x8), "
                             f"torch {torch.__version__}")
    out_path = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "rrdbnet_parity.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_path), metadata=metadata)
    print(f"wrote {out_path} ({out_path.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
