"""Parity fixture for CLIP: open_clip's `open_clip.model.CLIP` (PyPI `open-clip-torch`
3.3.0) built at a tiny ViT size with random weights, its state dict, inputs (raw images,
the pixels open_clip's evaluation transform makes of them, token ids) and outputs (image
and text features, logits), saved as tests/fixtures/clip_parity.safetensors. The C++ test
(tests/models/clip_test.cpp) loads the weights by name and must reproduce every output to
1e-4 relative error.

Covered: both activations (the same weights run through a GELU model and a QuickGELU one),
both text poolings (`argmax`, open_clip's default, and `eos` with eos_id 3 on captions
whose largest id is not the end of text), and open_clip's evaluation transform
(`image_transform(32, is_train=False)`: bicubic antialiased resize of the shorter side,
centre crop, CLIP's mean/std) applied to tensors, from 40x36 images so that the crop offset
(1.5) exercises Python's round-half-to-even.

The reference lives in its own virtual environment; torch, numpy and safetensors come from
the project's venv through a .pth file (torchvision must match its torch, 2.11 -> 0.26;
huggingface_hub and timm are optional imports and not needed):
    python3 -m venv ~/.cache/dalle/clip-venv
    ~/.cache/dalle/clip-venv/bin/pip install --no-deps open-clip-torch==3.3.0 \\
        torchvision==0.26.0 pillow ftfy wcwidth regex tqdm
    ~/.cache/dalle/venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \\
        > ~/.cache/dalle/clip-venv/lib/python3.11/site-packages/dalle-torch.pth
    ~/.cache/dalle/clip-venv/bin/python tests/parity/make_clip_fixture.py

Weights are small integers times a power of two per tensor, stored as int8 beside that
scale (`<name>` I8 and `<name>:scale` F32), as in make_vqgan_fixture.py: the model computes
with exactly those values and the file stays small (about 300 KB, most of it the float32 images).
"""
import pathlib

import open_clip
import torch
from safetensors.torch import save_file

from quantized_weights import quantized_randomize

EMBED_DIM = 16
VISION = dict(image_size=32, patch_size=8, width=48, layers=2, head_width=8, mlp_ratio=4.0)  # 6 heads
TEXT = dict(context_length=12, vocab_size=64, width=32, heads=4, layers=3, mlp_ratio=4.0)
EOS_ID = 3
IMAGES, CAPTIONS = 6, 4


def build(quick_gelu, **text_overrides):
    return open_clip.model.CLIP(EMBED_DIM, dict(VISION), dict(TEXT, **text_overrides), quick_gelu=quick_gelu).eval()


def captions(generator, end_id, low, high):
    """CAPTIONS rows of TEXT's context length: random ids in [low, high), the end id, zeros.
    The last row fills the context, its end id in the last position."""
    length = TEXT["context_length"]
    rows = torch.zeros(CAPTIONS, length, dtype=torch.int64)
    for row in range(CAPTIONS):
        n = length - 1 if row == CAPTIONS - 1 else int(torch.randint(2, length - 2, (), generator=generator))
        rows[row, :n] = torch.randint(low, high, (n,), generator=generator)
        rows[row, n] = end_id
    return rows


def main():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build(quick_gelu=False)
    tensors = quantized_randomize(model, generator)
    quick = build(quick_gelu=True)
    quick.load_state_dict(model.state_dict())
    eos = build(quick_gelu=False, pool_type="eos", eos_id=EOS_ID)
    eos.load_state_dict(model.state_dict())

    images = torch.rand(IMAGES, 3, 40, 36, generator=generator)
    transform = open_clip.image_transform(VISION["image_size"], is_train=False)
    pixels = transform(images)
    vocab = TEXT["vocab_size"]
    # argmax pooling: the end of text is the largest id, as in CLIP's BPE.
    tokens = captions(generator, vocab - 1, 4, vocab - 1)
    # eos pooling: the end of text is id 3 and larger ids (up to the largest) precede it.
    tokens_eos = captions(generator, EOS_ID, 4, vocab)
    tokens_eos[0, 0] = vocab - 1
    assert not torch.equal(tokens_eos.argmax(1), (tokens_eos == EOS_ID).int().argmax(1))

    out = {"images": images, "pixels": pixels, "tokens": tokens, "tokens_eos": tokens_eos}
    with torch.no_grad():
        for prefix, m in (("gelu", model), ("quick_gelu", quick)):
            out[f"{prefix}.image_features"] = m.encode_image(pixels)
            out[f"{prefix}.text_features"] = m.encode_text(tokens)
            per_image, per_text = m.get_logits(pixels, tokens)
            out[f"{prefix}.logits_per_image"] = per_image
            out[f"{prefix}.logits_per_text"] = per_text
        out["eos.text_features"] = eos.encode_text(tokens_eos)
    tensors |= out

    path = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "clip_parity.safetensors"
    metadata = {"embed_dim": str(EMBED_DIM), "eos_id": str(EOS_ID)}
    metadata |= {f"vision_{k}": str(v) for k, v in VISION.items()}
    metadata |= {f"text_{k}": str(v) for k, v in TEXT.items()}
    metadata["generator"] = f"open_clip {open_clip.__version__} CLIP, torch {torch.__version__}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
