"""Parity fixture for ruCLIP: the `ruclip` package's own `ruclip.model.CLIP` and
`RuCLIPProcessor` (PyPI ruclip 0.0.2, the reranker of ruDALL-E's README) built at a tiny size
with random weights, its state dict, inputs (raw images, the pixels ruclip's processor makes
of them, the ids its tokenizer gives Russian captions) and outputs (image and text features,
logits, ruDALL-E's cherry-pick scores), saved as tests/fixtures/ruclip_parity.safetensors.
The C++ tests (tests/models/clip_test.cpp, `RuclipParity.*`) load the weights by name and
must reproduce every output to 1e-4 relative error, and our YouTokenToMe tokenizer must give
ruclip's ids.

What ruclip 0.0.2 does, and the fixture covers:
* the model is OpenAI CLIP's ViT under the same names (QuickGELU, pre-LayerNorm blocks, a
  causal text transformer), with vision heads fixed at vision_width // 64 and the caption's
  feature read at its end of text, `torch.where(input_ids == eos_id)`, eos_id 3;
* `RuCLIPProcessor.encode_text`: `text.lower()` (no strip), YouTokenToMe ids cut to
  context_length - 2, then BOS (2), the ids, EOS (3), zeros to context_length; one caption
  here runs past the context, one has upper case and surrounding spaces;
* its image transform: `RandomResizedCrop(size, scale=(1, 1), ratio=(1, 1))` on a PIL image,
  which for any image whose sides differ by more than one pixel is torchvision's fallback:
  the centred square of the shorter side, offsets floored, then a bilinear antialiased resize
  to image_resolution; then CLIP's mean and std. Square 24x24 images are upsampled (as
  ruDALL-E's 256-pixel images are to 384), 43x36 ones cropped from row 3 (open_clip's rounding
  would take row 4) and downsampled. `pixels_*` are the processor's output on 8-bit PIL images
  (PIL rounds its resize to 8 bits); `tensor_pixels_*` the same transforms on float tensors,
  which is what the C++ preprocessing computes;
* ruDALL-E's `cherry_pick_by_ruclip` (rudalle 1.1.3) scores images with
  `ruclip.Predictor.get_text_latents([text])`: the mean of the raw text features of the
  prompt, lower-cased and stripped, in each of the Predictor's six Russian templates, then
  normalised; the score is its cosine with each normalised image feature (`cherry.*`). The
  prompt starts with a no-break space, which strip() removes and youtokentome would not.

The tokenizer is the YouTokenToMe fixture model (tests/fixtures/yttm_bpe.model, 600 ids);
ruCLIP's own bpe.model is not ours to commit.

The reference lives in its own virtual environment; torch, numpy and safetensors come from
the project's venv through a .pth file. youtokentome builds from source (Cython); ruclip's
`huggingface_hub` import (downloads only) is stubbed, more-itertools and tqdm are imported by
its Predictor:
    python3 -m venv ~/.cache/dalle/ruclip-venv
    ~/.cache/dalle/ruclip-venv/bin/pip install --no-deps ruclip==0.0.2 torchvision==0.26.0 \\
        pillow more-itertools tqdm Cython packaging "setuptools>=70.1" wheel
    ~/.cache/dalle/ruclip-venv/bin/pip install --no-deps --no-build-isolation youtokentome==1.0.6
    ~/.cache/dalle/venv/bin/python -c 'import site; print(site.getsitepackages()[0])' \\
        > ~/.cache/dalle/ruclip-venv/lib/python3.11/site-packages/dalle-torch.pth
    ~/.cache/dalle/ruclip-venv/bin/python tests/parity/make_ruclip_fixture.py

Weights are small integers times a power of two per tensor, stored as int8 beside that scale
(`<name>` I8 and `<name>:scale` F32; quantized_weights.py), as in make_clip_fixture.py.
"""
import json
import pathlib
import sys
import types

import torch
from safetensors.torch import save_file

from quantized_weights import quantized_randomize

hub = types.ModuleType("huggingface_hub")  # ruclip/__init__.py imports it for ruclip.load's downloads
hub.hf_hub_url = hub.cached_download = None
sys.modules.setdefault("huggingface_hub", hub)

import ruclip  # noqa: E402
from PIL import Image  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
SIZES = dict(embed_dim=16, image_resolution=32, vision_layers=2, vision_width=64, vision_patch_size=8,
             context_length=16, vocab_size=600, transformer_width=32, transformer_heads=4, transformer_layers=2)
CAPTIONS = [
    "красная сумка слева",
    "  Синие КРОССОВКИ справа ",
    "картина маслом: девушка в шляпе",
    "зимний город ночью, море и корабль, горы и озеро, фотография цветов в вазе на столе у окна",
]
PROMPT = "\u00a0 Красная СУМКА слева "  # Python's strip() takes the no-break space too


def pil(image):
    """[3, H, W] uint8 -> an RGB PIL image."""
    return Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


def main():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = ruclip.CLIP(**SIZES).eval()
    tensors = quantized_randomize(model, generator)
    vision_heads = model.visual.transformer.resblocks[0].attn.num_heads
    assert vision_heads == SIZES["vision_width"] // 64 == 1
    processor = ruclip.RuCLIPProcessor(str(FIXTURES / "yttm_bpe.model"), image_size=SIZES["image_resolution"],
                                       text_seq_length=SIZES["context_length"])
    transform = processor.image_transform.transforms
    assert isinstance(transform[1], ruclip.processor.T.RandomResizedCrop) and len(transform) == 4
    tensor_transform = ruclip.processor.T.Compose([transform[1], transform[3]])  # no PIL conversion, ToTensor

    out = {}
    tokens = processor(text=CAPTIONS)["input_ids"]
    assert tokens.shape == (len(CAPTIONS), SIZES["context_length"]) and tokens[-1, -1] == processor.eos_id
    out["tokens"] = tokens
    with torch.no_grad():
        for kind, (height, width) in (("square", (24, 24)), ("tall", (43, 36))):
            images = torch.randint(0, 256, (3, 3, height, width), generator=generator, dtype=torch.uint8)
            pixels = processor(images=[pil(image) for image in images])["pixel_values"]
            tensor_pixels = torch.stack([tensor_transform(image.float() / 255) for image in images])
            out[f"images_{kind}"] = images
            out[f"pixels_{kind}"] = pixels
            out[f"tensor_pixels_{kind}"] = tensor_pixels
            out[f"{kind}.image_features"] = model.encode_image(pixels)
            out[f"{kind}.tensor_image_features"] = model.encode_image(tensor_pixels)
            per_image, per_text = model(tokens, pixels)
            out[f"{kind}.logits_per_image"] = per_image
            out[f"{kind}.logits_per_text"] = per_text
        out["text_features"] = model.encode_text(tokens)

        # ruDALL-E's cherry_pick_by_ruclip, its images the tensor path's pixels.
        predictor = ruclip.Predictor(model, processor, "cpu", bs=8, quiet=True)
        filled = [template.format(PROMPT.lower().strip()) for template in predictor.templates]
        out["cherry.template_tokens"] = processor(text=filled)["input_ids"]
        text_latents = predictor.get_text_latents([PROMPT])
        pixels = torch.cat([out["tensor_pixels_square"], out["tensor_pixels_tall"]])
        image_latents = model.encode_image(pixels)
        image_latents = image_latents / image_latents.norm(dim=-1, keepdim=True)
        out["cherry.text_latents"] = text_latents
        out["cherry.scores"] = (image_latents @ text_latents.t()).view(-1)
        single = model.encode_text(out["cherry.template_tokens"][:1])
        single = single / single.norm(dim=-1, keepdim=True)
        # The templates move the ranking's scores: the test would notice one template alone.
        assert (image_latents @ single.t()).view(-1).sub(out["cherry.scores"]).abs().max() > 1e-3
    tensors |= out

    path = FIXTURES / "ruclip_parity.safetensors"
    metadata = {k: str(v) for k, v in SIZES.items()}
    metadata |= {"captions": json.dumps(CAPTIONS, ensure_ascii=False), "prompt": PROMPT,
                 "templates": json.dumps(predictor.templates, ensure_ascii=False),
                 "vision_heads": str(vision_heads), "eos_id": str(model.eos_id),
                 "generator": f"ruclip {ruclip.__version__} CLIP and RuCLIPProcessor, torch {torch.__version__}"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
