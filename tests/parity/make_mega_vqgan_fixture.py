"""Parity fixture for DALL-E Mega's image encoder: taming-transformers' own `VQModel` (PyPI
`taming-transformers` 0.0.1), the model dalle-mini's VQGAN (vqgan_imagenet_f16_16384) was
converted from, with random weights in Mega's f16 layout at small widths: five levels (four
2x downsamplings), two residual blocks a level, attention at the lowest resolution only, the
vector quantizer. Saved as tests/fixtures/mega_vqgan_parity.safetensors:
  - the encoder, quant_conv and codebook (quantize.embedding.weight), as int8 values beside a
    power-of-two scale each (`<name>` I8, `<name>:scale` F32; make_vqgan_fixture.py's trick);
  - `images` [3, 3, 64, 64] in [0, 1], multiples of 1/255 so that 8-bit PNGs hold them exactly;
  - `latents`: quant_conv(encoder(images)), what the quantizer receives, images as they are;
  - `codes`: VQModel.encode(images)'s indices, [3, 4, 4]: dalle-mini's use (pixel_range
    zero_to_one); `codes.minus_one_to_one`: VQModel.encode(2 * images - 1), taming's range;
  - `latents.vqgan_jax_2021`, `codes.vqgan_jax_2021`: the same images (in [0, 1]) through the
    same modules called in vqgan-jax's order before its 2022-07-09 fix (level_attention
    vqgan_jax_2021): at a level that attends, every attention block after each residual block
    (block 0, attn 0, attn 1, block 1, attn 0, attn 1), where taming runs block i, attn i.
    The order is that of patil-suraj/vqgan-jax's DownsamplingBlock.__call__ up to commit
    1be20ee (2022-04-20), changed by caafeee ("fix: encoder attn", pull request 10); the mid
    block (block_1, attn_1, block_2) was never affected. It is built from taming's modules,
    not from vqgan-jax, which needs jax and flax;
  - metadata `decoder_shapes`: the names and shapes of taming's decoder and post_quant_conv
    (JSON), so that a test can complete the state dict (any decoder values leave the codes as
    they are) without 1 MB of decoder weights in the repository.
The C++ test (VqganTest's MegaVqganParity.*) must reproduce the codes exactly and the latents
to 1e-4, in both orders; tests/tools/import_mega_vqgan_test.py follows the weights through
scripts/export_mega_vqgan.py (taming's checkpoint and dalle-mini's Flax msgpack) and
dalle-encode-images.

The reference lives in its own virtual environment; torch and safetensors come from the
project's venv through a .pth file:
    python3 -m venv ~/.cache/dalle/taming-venv
    ~/.cache/dalle/taming-venv/bin/pip install --no-deps taming-transformers==0.0.1
    ~/.cache/dalle/venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \
        > ~/.cache/dalle/taming-venv/lib/python3.11/site-packages/dalle-torch.pth
    ~/.cache/dalle/taming-venv/bin/python tests/parity/make_mega_vqgan_fixture.py

taming/models/vqgan.py imports pytorch_lightning and taming.main (OmegaConf, PIL, torchvision,
Lightning's Trainer) for training alone: pytorch_lightning is stood in for by a module whose
LightningModule is torch.nn.Module, and taming.main by one whose instantiate_from_config gives
an Identity for the loss (LPIPS and the discriminator, unused by encode). VQModel's __init__ and
encode, the Encoder and the VectorQuantizer run as released.
"""
import importlib
import json
import pathlib
import sys
import types

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_vqgan_fixture import quantized_randomize  # noqa: E402


def import_reference():
    lightning = types.ModuleType("pytorch_lightning")
    lightning.LightningModule = torch.nn.Module
    sys.modules["pytorch_lightning"] = lightning
    importlib.import_module("taming")
    main = types.ModuleType("taming.main")
    main.instantiate_from_config = lambda config: torch.nn.Identity()
    sys.modules["taming.main"] = main
    return importlib.import_module("taming.models.vqgan")


# Mega's: ch 128, ch_mult [1, 1, 2, 2, 4], num_res_blocks 2, attn_resolutions [16] at resolution
# 256, z_channels = embed_dim = 256, 16384 codes. Here the widths are taming's smallest (its
# GroupNorm has 32 groups) and the width changes once, at level 3 (a nin_shortcut).
DDCONFIG = dict(double_z=False, z_channels=32, resolution=64, in_channels=3, out_ch=3, ch=32,
                ch_mult=[1, 1, 1, 2, 2], num_res_blocks=2, attn_resolutions=[4], dropout=0.0)
N_EMBED, EMBED_DIM = 128, 32
ENCODER = ("encoder.", "quant_conv.", "quantize.")


def codebook_like(latents, generator):
    """Codes spread like the latents (per channel mean and spread), as int8 times 2^-e: random
    codes of the default +-1/K would all sit at the origin and one would win everywhere."""
    flat = latents.permute(0, 2, 3, 1).reshape(-1, EMBED_DIM)
    values = flat.mean(0) + flat.std(0) * torch.randn(N_EMBED, EMBED_DIM, generator=generator)
    e = int(torch.floor(torch.log2(127 / values.abs().max())).item())
    q = torch.round(values * 2.0 ** e).clamp(-127, 127)
    return q.to(torch.int8), 2.0 ** -e


def encode_in_order(encoder, x, order):
    """taming's Encoder.forward with the attention order of a level made explicit: "taming"
    (block i, then attn i) or "vqgan_jax_2021" (after each residual block, every attention
    block of the level in order). Every module called is taming's own."""
    h = encoder.conv_in(x)
    for level in encoder.down:
        for i, block in enumerate(level.block):
            h = block(h, None)
            for attention in (level.attn if order == "vqgan_jax_2021" else level.attn[i:i + 1]):
                h = attention(h)
        if hasattr(level, "downsample"):
            h = level.downsample(h)
    h = encoder.mid.block_2(encoder.mid.attn_1(encoder.mid.block_1(h, None)), None)
    h = encoder.norm_out(h)
    return encoder.conv_out(h * torch.sigmoid(h))


def margins(latents, codebook):
    """Per position, the squared distance of the second nearest code minus the nearest's."""
    flat = latents.permute(0, 2, 3, 1).reshape(-1, EMBED_DIM).double()
    distances = torch.cdist(flat, codebook.double()) ** 2
    two = distances.topk(2, dim=1, largest=False).values
    return two[:, 1] - two[:, 0]


def main():
    vqgan = import_reference()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = vqgan.VQModel(DDCONFIG, lossconfig=None, n_embed=N_EMBED, embed_dim=EMBED_DIM).eval()
    tensors = quantized_randomize(model, generator)
    images = torch.randint(0, 256, (3, 3, 64, 64), generator=generator).float() / 255

    with torch.no_grad():
        latents = model.quant_conv(model.encoder(images))
        q, scale = codebook_like(latents, generator)
        model.quantize.embedding.weight.copy_(q.float() * scale)
        tensors["quantize.embedding.weight"] = q
        tensors["quantize.embedding.weight:scale"] = torch.tensor(scale, dtype=torch.float32)
        _, _, (_, _, codes) = model.encode(images)
        _, _, (_, _, codes_taming_range) = model.encode(2 * images - 1)
        grid = (len(images), 64 // 16, 64 // 16)
        codes, codes_taming_range = codes.reshape(grid), codes_taming_range.reshape(grid)
        taming_latents = model.quant_conv(model.encoder(2 * images - 1))

        # The function is taming's forward but for the order it is given.
        assert torch.equal(encode_in_order(model.encoder, images, "taming"), model.encoder(images))
        jax_latents = model.quant_conv(encode_in_order(model.encoder, images, "vqgan_jax_2021"))
        _, _, (_, _, codes_jax) = model.quantize(jax_latents)
        codes_jax = codes_jax.reshape(grid)
    changed = (codes_jax != codes).float().mean().item()
    print(f"vqgan_jax_2021 order: {100 * changed:.0f}% of the {codes.numel()} codes differ from taming's order")
    assert changed > 0.1, "the fixture must tell the orders apart"

    codebook = model.quantize.embedding.weight
    for name, z, c in (("zero_to_one", latents, codes), ("minus_one_to_one", taming_latents, codes_taming_range),
                       ("vqgan_jax_2021", jax_latents, codes_jax)):
        gap = margins(z, codebook)
        print(f"{name}: {c.unique().numel()} distinct codes of {c.numel()}; nearest-code margins "
              f"min {gap.min():.3g}, median {gap.median():.3g} (squared distances)")
        assert c.unique().numel() >= c.numel() // 4, "too few distinct codes to tell an error"
        assert gap.min() > 1e-3 * gap.median(), "a near tie: float order could flip a code"

    decoder = {name: list(p.shape) for name, p in model.state_dict().items()
               if name.startswith(("decoder.", "post_quant_conv."))}
    kept = {k: v for k, v in tensors.items() if k.split(":")[0].startswith(ENCODER)}
    kept |= {"images": images, "latents": latents, "codes": codes, "codes.minus_one_to_one": codes_taming_range,
             "latents.vqgan_jax_2021": jax_latents, "codes.vqgan_jax_2021": codes_jax}
    out = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "mega_vqgan_parity.safetensors"
    metadata = {k: json.dumps(v) for k, v in DDCONFIG.items()}
    metadata |= {"n_embed": str(N_EMBED), "embed_dim": str(EMBED_DIM), "decoder_shapes": json.dumps(decoder),
                 "generator": f"taming-transformers 0.0.1 VQModel, torch {torch.__version__}"}
    save_file({k: v.contiguous() for k, v in kept.items()}, str(out), metadata=metadata)
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(kept)} tensors)")


if __name__ == "__main__":
    main()
