"""dalle.Pipeline: text to images, as dalle-generate draws them."""
import io
import json

import torch

from . import _dalle
from ._config import assignments


class Image:
    """One generated image, best first within its prompt.

    prompt, candidate (which of the prompt's samples), rank (0: the best by CLIP score), seed,
    top_k, top_p, clip_score (None without CLIP); tensor ([3, H, W] float in [0, 1]) and tokens
    ([grid, grid] image tokens), the library's own tensors; png (the PNG dalle-generate writes,
    with its metadata in a text chunk), metadata (that JSON as a dict), image (a PIL image; needs
    pillow) and save(path)."""

    def __init__(self, generated, settings):
        self._generated, self._settings, self._png = generated, settings, None

    prompt = property(lambda self: self._generated.prompt)
    candidate = property(lambda self: self._generated.candidate)
    rank = property(lambda self: self._generated.rank)
    seed = property(lambda self: self._generated.seed)
    top_k = property(lambda self: self._generated.top_k)
    top_p = property(lambda self: self._generated.top_p)
    clip_score = property(lambda self: self._generated.clip_score)
    tensor = property(lambda self: self._generated.image)
    tokens = property(lambda self: self._generated.tokens)

    @property
    def png(self):
        if self._png is None:
            self._png = self._settings.png(self._generated)
        return self._png

    @property
    def metadata(self):
        return json.loads(self._settings.metadata(self._generated))

    @property
    def image(self):
        from PIL import Image as PilImage  # only when asked for: the rest needs no pillow
        picture = PilImage.open(io.BytesIO(self.png))
        picture.load()
        return picture

    def save(self, path):
        """Writes the PNG (with its metadata), as dalle-generate does."""
        with open(path, "wb") as file:
            file.write(self.png)

    def _repr_png_(self):  # shown inline by notebooks
        return self.png

    def __repr__(self):
        score = "" if self.clip_score is None else f", clip_score={self.clip_score:.3f}"
        return f"<dalle.Image {self.prompt!r} rank={self.rank} candidate={self.candidate} seed={self.seed}{score}>"


class Preview:
    """A candidate as drawn so far (generate's on_preview): request (which prompt), candidate,
    drawn of total image positions, tokens (0 where none is drawn yet) and tensor ([3, H, W],
    white where nothing is drawn yet); image as a PIL image."""

    def __init__(self, shown):
        self.request, self.candidate = shown["request"], shown["candidate"]
        self.drawn, self.total = shown["drawn"], shown["total"]
        self.tokens, self.tensor = shown["tokens"], shown["image"]

    @property
    def image(self):
        from PIL import Image as PilImage
        pixels = (self.tensor.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()
        return PilImage.fromarray(pixels.numpy())

    def __repr__(self):
        return f"<dalle.Preview request={self.request} candidate={self.candidate} {self.drawn}/{self.total}>"


def _image_tensor(image):
    """[3, H, W] float in [0, 1] of a PIL image or a tensor."""
    if isinstance(image, torch.Tensor):
        if image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"image_prompt: a tensor must be [3, H, W] in [0, 1], not {list(image.shape)}")
        return image
    try:
        import numpy
        pixels = numpy.asarray(image.convert("RGB"))
    except AttributeError:
        raise ValueError("image_prompt: a PIL image or a [3, H, W] tensor") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255


def _positive(name, value):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")


class Pipeline:
    """Text to images: the library's generation pipeline, loaded once.

    Pipeline(model_or_config, **overrides): a model folder (its generate.yaml, as
    dalle-generate --model reads it) or a pipeline config file; keyword arguments override its
    keys, a dict for a section: Pipeline("models/fashion-compose", candidates=8,
    sampling={"top_k": 64}) or **{"sampling.top_k": 64}. A bad key or value raises
    dalle.ConfigError naming it. Loading and generating release the GIL."""

    def __init__(self, model_or_config, **overrides):
        self._pipeline = _dalle.Pipeline(str(model_or_config), assignments(overrides))
        self.settings = dict(self._pipeline.settings.items())

    def image_size(self, superres=True):
        """The side of the images generate returns, with or without super-resolution."""
        return self._pipeline.image_size(superres)

    def generate(self, prompts, *, n=None, candidates=None, seed=None, temperature=None, top_k=None, top_p=None,
                 guidance_scale=None, superres=None, adapters=None, image_prompt=None, image_prompt_rows=None,
                 on_preview=None, preview_every=None):
        """Images for a prompt (a list of Image, best first) or for each of a list of prompts (a
        list of such lists). Every keyword left None keeps the pipeline's setting.

        n: images kept per prompt, the best by CLIP score (dalle-generate's -n): `candidates`
        becomes at least n (n without CLIP); candidates: images sampled per prompt; seed, temperature,
        top_k, top_p (either replaces the pipeline's schedule), guidance_scale; superres: upscale
        or not; adapters: {"NAME": weight} or ["NAME"] of the pipeline's named_adapters;
        image_prompt: a PIL image or [3, H, W] tensor whose top image_prompt_rows token rows every
        sample keeps; on_preview: called with a list of Preview every preview_every image
        positions (default: 8 previews) while the candidates are drawn. Prompt i draws sampling
        streams (i, candidate) of the seed, as dalle-generate's i-th prompt does."""
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if not prompts or not all(isinstance(prompt, str) for prompt in prompts):
            raise ValueError("prompts: a string or a non-empty list of strings")
        _positive("n", n)
        _positive("candidates", candidates)
        keep = n
        if n is not None and candidates is None:
            sampled = int(self.settings["candidates"])
            candidates = max(sampled, n) if self.settings["clip"] else n
        if n is not None and candidates < n:
            raise ValueError(f"candidates ({candidates}) is fewer than n ({n}): n of the candidates are kept")
        if isinstance(adapters, (list, tuple)):
            adapters = {name: 1.0 for name in adapters}
        if (image_prompt is None) != (image_prompt_rows is None):
            raise ValueError("image_prompt and image_prompt_rows go together")
        every = 0
        if on_preview is not None:
            every = preview_every or max(1, self._pipeline.image_tokens() // 8)
        shown = None if on_preview is None else (lambda previews: on_preview([Preview(p) for p in previews]))
        generated = self._pipeline.generate(
            prompts, keep=keep, candidates=candidates, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
            guidance_scale=guidance_scale, superres=superres, adapters=adapters or {},
            image_prompt=None if image_prompt is None else _image_tensor(image_prompt),
            image_prompt_rows=image_prompt_rows or 0, preview_every=every, on_preview=shown)
        results = [[Image(image, settings) for image in images] for settings, images in generated]
        return results[0] if single else results

    def __repr__(self):
        return f"<dalle.Pipeline prior={self.settings['prior']!r} device={self.settings['device']!r}>"
