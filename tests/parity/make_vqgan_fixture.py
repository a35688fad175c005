"""Parity fixture for the VQGAN: ruDALL-E's `rudalle.vae.model.GumbelVQ` (PyPI `rudalle`
1.1.3, built on `taming-transformers` 0.0.1) with random weights at a small size, its state
dict, input images and the outputs of ruDALL-E's own token paths, saved as
tests/fixtures/vqgan_parity.safetensors. The C++ test loads the weights by name and must
reproduce the encoder logits and decoded images to 1e-4 relative error and the tokens
exactly. A taming `VectorQuantizer` case covers the classic quantizer.

The reference lives in its own virtual environment; torch and safetensors come from the
project's venv through a .pth file:
    python3 -m venv ~/.cache/dalle/rudalle-venv
    ~/.cache/dalle/rudalle-venv/bin/pip install --no-deps rudalle==1.1.3 \
        taming-transformers==0.0.1 einops==0.3.2
    ~/.cache/dalle/venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \
        > ~/.cache/dalle/rudalle-venv/lib/python3.11/site-packages/dalle-torch.pth
    ~/.cache/dalle/rudalle-venv/bin/python tests/parity/make_vqgan_fixture.py

`import rudalle` fails (its __init__ needs huggingface_hub.cached_download and
transformers ~4.10), so the package and `rudalle.vae` are registered as bare packages and
only `rudalle/vae/model.py` runs; its DWT decoder (pywt) is stubbed, it is not used here.

Weights are small integers times a power of two per tensor, stored as int8 beside that
scale (`<name>` I8 and `<name>:scale` F32): the model computes with exactly those values,
and the file stays under 1.5 MB (fp32 weights alone would be 3 MB).
"""
import importlib
import pathlib
import sys
import types

import torch
from safetensors.torch import save_file


def import_reference():
    site = next(pathlib.Path(p) for p in sys.path if (pathlib.Path(p) / "rudalle/vae/model.py").exists())
    for name in ("rudalle", "rudalle.vae"):
        package = types.ModuleType(name)
        package.__path__ = [str(site / name.replace(".", "/"))]
        sys.modules[name] = package
    dwt = types.ModuleType("rudalle.vae.decoder_dwt")
    dwt.DecoderDWT = None
    sys.modules["rudalle.vae.decoder_dwt"] = dwt
    vae = importlib.import_module("rudalle.vae.model")
    quantize = importlib.import_module("taming.modules.vqvae.quantize")
    return vae, quantize


DDCONFIG = dict(double_z=False, z_channels=32, resolution=32, in_channels=3, out_ch=3, ch=32,
                ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[16], dropout=0.0)
N_EMBED, EMBED_DIM = 64, 32


def quantized_randomize(module, generator):
    """Gives every parameter random values q * 2^-e with |q| <= 127; returns q and e by name.
    GroupNorm gains sit around 1 and its biases away from 0, so that the affine part of the
    normalisation is exercised."""
    stored = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or ".norm1.weight" in name or ".norm2.weight" in name \
                    or name.endswith("norm_out.weight"):
                q = torch.randint(64, 128, p.shape, generator=generator)  # gains in [0.5, 1)
                e = 7
            elif p.dim() == 1:
                q = torch.randint(-127, 128, p.shape, generator=generator)
                e = 9  # biases within +-0.25
            else:
                fan_in = p[0].numel() if not name.endswith("embed.weight") else 1
                # about N(0, 1/fan_in): uniform +-127 has std 73, scaled to ~sqrt(3/fan_in)
                e = max(0, round(torch.log2(torch.tensor(127.0 * fan_in ** 0.5 / 3 ** 0.5)).item()))
                q = torch.randint(-127, 128, p.shape, generator=generator)
            p.copy_(q.float() * 2.0 ** -e)
            stored[name] = q.to(torch.int8)
            stored[name + ":scale"] = torch.tensor(2.0 ** -e, dtype=torch.float32)
    return stored


def main():
    vae, quantize = import_reference()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = vae.GumbelVQ(DDCONFIG, n_embed=N_EMBED, embed_dim=EMBED_DIM).eval()
    tensors = quantized_randomize(model, generator)

    images = torch.rand(2, 3, 32, 32, generator=generator)
    with torch.no_grad():
        # ruDALL-E's get_codebook_indices: img * 2 - 1, encode with disable_gumbel_softmax.
        h = model.quant_conv(model.encoder(2 * images - 1))
        _, _, _, logits = model.quantize(h, return_logits=True, disable_gumbel_softmax=True)
        _, _, (_, _, tokens) = model.encode(2 * images - 1, disable_gumbel_softmax=True)
        assert torch.equal(tokens, logits.argmax(1))
        # ruDALL-E's decode: one-hot @ codebook, post_quant_conv, decoder, clamp, (x + 1) / 2.
        one_hot = torch.nn.functional.one_hot(tokens.flatten(1), N_EMBED).float()
        z = (one_hot @ model.quantize.embed.weight).transpose(1, 2).reshape(2, EMBED_DIM, 16, 16)
        decoded = (model.decode(z).clamp(-1.0, 1.0) + 1) * 0.5

        # taming's classic quantizer on the same latents: nearest code, (1 + beta) * MSE.
        vq = quantize.VectorQuantizer(N_EMBED, EMBED_DIM, beta=0.25)
        vq.embedding.weight.copy_(torch.randn(N_EMBED, EMBED_DIM, generator=generator) * h.std())
        vq_z_q, vq_loss, (_, _, vq_indices) = vq(h)

    tensors |= {"images": images, "logits": logits, "tokens": tokens, "decoded": decoded,
                "vq.embedding.weight": vq.embedding.weight.clone(), "vq.z": h, "vq.z_q": vq_z_q,
                "vq.loss": vq_loss.reshape(()), "vq.tokens": vq_indices.reshape(tokens.shape)}
    out = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vqgan_parity.safetensors"
    metadata = {k: str(v) for k, v in DDCONFIG.items()}
    metadata |= {"n_embed": str(N_EMBED), "embed_dim": str(EMBED_DIM), "vq_beta": "0.25",
                 "generator": f"rudalle 1.1.3 GumbelVQ, taming-transformers 0.0.1, torch {torch.__version__}"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=metadata)
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
