#!/usr/bin/env python3
"""ImportModel: scripts/export_mega_vqgan.py turns taming's VQGAN checkpoint and dalle-mini's
Flax weights (flax_model.msgpack) into the same checkpoint, whose tokens from
dalle-encode-images are taming's modules' codes in vqgan-jax's old attention order (the
default, level_attention vqgan_jax_2021) or taming's VQModel.encode codes (--level-attention
taming); scripts/import-model mega --vqgan puts it in a model folder as encoder/, which the
folder's generate.yaml names as its image prompts' encoder.

Usage: import_mega_vqgan_test.py SOURCE_DIR TOOLS_DIR  (ctest runs it with the project's venv)

The released files are stand-ins made from tests/fixtures/mega_vqgan_parity.safetensors
(taming's own VQModel with random weights in DALL-E Mega's f16 layout at small widths;
tests/parity/make_mega_vqgan_fixture.py): its encoder, quant_conv and codebook, with a
decoder of the shapes taming built (random values: no code depends on them):
  - last.ckpt, as Lightning saves one: `state_dict` with the loss's tensors beside the model's,
    and objects of a class importable only where the file was written (Lightning's callbacks);
  - flax_model.msgpack, the same tensors under vqgan-jax's names and layouts, serialized as
    flax.serialization does (msgpack extension type 1 holding shape, dtype name and bytes; the
    codebook as a chunked array). The mapping here is written apart from the exporter's.
The images are the fixture's, as 8-bit PNGs, which hold them exactly.
"""
import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
import zlib

import msgpack
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from release_files import dequantized, run

SOURCE, TOOLS = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
FIXTURE = SOURCE / "tests" / "fixtures" / "mega_vqgan_parity.safetensors"
EXPORT = [sys.executable, SOURCE / "scripts" / "export_mega_vqgan.py"]


def reference_state():
    """The fixture's VQModel state dict: its encoder, quant_conv and codebook, a random decoder."""
    state = dequantized(FIXTURE)
    with safe_open(str(FIXTURE), "pt") as f:
        decoder = json.loads(f.metadata()["decoder_shapes"])
    generator = torch.Generator().manual_seed(0)
    state |= {name: torch.randn(shape, generator=generator) * 0.05 for name, shape in decoder.items()}
    return state


LIGHTNING_STAND_IN = '''
class ModelCheckpoint:
    def __init__(self):
        self.best_model_path = "epoch=3.ckpt"
'''


def write_taming_checkpoint(work, state):
    """torch.save of a Lightning-like checkpoint, in a process where its callback class imports."""
    package = work / "stand-in"
    package.mkdir()
    (package / "lightning_stand_in.py").write_text(LIGHTNING_STAND_IN)
    torch.save(state | {"loss.discriminator.main.0.weight": torch.zeros(4, 3, 4, 4)}, work / "state.pt")
    script = ("import torch\nfrom lightning_stand_in import ModelCheckpoint\n"
              f"state = torch.load({str(work / 'state.pt')!r})\n"
              "torch.save({'state_dict': state, 'epoch': 3, 'callbacks': {ModelCheckpoint: {'best': 1.0}},\n"
              f"            'hyper_parameters': ModelCheckpoint()}}, {str(work / 'last.ckpt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": str(package)})
    return work / "last.ckpt"


def flax_leaf(name, tensor):
    """A taming tensor -> vqgan-jax's path and array (HWIO kernels, GroupNorm scales)."""
    parts, leaf = name.split(".")[:-1], name.split(".")[-1]
    path, i = [], 0
    while i < len(parts):
        if parts[i] in ("down", "up", "block", "attn") and i + 1 < len(parts) and parts[i + 1].isdigit():
            path.append(f"{parts[i]}_{parts[i + 1]}")
            i += 2
        else:
            path.append(parts[i])
            i += 1
    array = tensor.numpy()
    if leaf == "bias":
        return path + ["bias"], array
    if array.ndim == 4:
        return path + ["kernel"], array.transpose(2, 3, 1, 0)
    if path[-1] == "embedding":
        return path + ["embedding"], array
    return path + ["scale"], array


def chunked(array, pieces):
    flat = array.reshape(-1)
    size = -(-flat.size // pieces)
    return {"__msgpack_chunked_array__": True, "shape": {str(i): n for i, n in enumerate(array.shape)},
            "chunks": {str(i): flat[i * size:(i + 1) * size] for i in range(pieces)}}


def write_flax_msgpack(path, state):
    tree = {}
    for name, tensor in state.items():
        keys, array = flax_leaf(name, tensor)
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = chunked(array, 3) if keys[-1] == "embedding" else np.ascontiguousarray(array)

    def ext(value):
        if isinstance(value, np.ndarray):
            packed = msgpack.packb((value.shape, value.dtype.name, value.tobytes("C")), use_bin_type=True)
            return msgpack.ExtType(1, packed)
        return value

    path.write_bytes(msgpack.packb(tree, default=ext, strict_types=True))
    return path


def write_png(path, image):
    """An 8-bit RGB PNG of a [3, H, W] image in [0, 1] (zlib alone)."""
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def encoded_tokens(work, checkpoint, dataset, tokenizer, name):
    out = work / name
    run([TOOLS / "dalle-encode-images", "--dataset", dataset, "--vqgan", checkpoint, "--tokenizer", tokenizer,
         "--out", out])
    shards = sorted(out.glob("shard-*.safetensors"))
    return torch.cat([load_file(str(shard))["image_tokens"].long() for shard in shards])


def main():
    fixture = load_file(str(FIXTURE))
    state = reference_state()
    with tempfile.TemporaryDirectory() as scratch:
        work = pathlib.Path(scratch)
        ckpt = write_taming_checkpoint(work, state)
        assert subprocess.run([sys.executable, "-c", "import lightning_stand_in"], capture_output=True).returncode, \
            "the export must run where the checkpoint's callback class cannot be imported"
        flax = write_flax_msgpack(work / "flax_model.msgpack", state)

        # Both sources give the same checkpoint: the reference's tensors, the loss's dropped.
        exported = run(EXPORT + ["--vqgan", ckpt, "--out", work / "from-taming", "--image-size", 64])
        assert "inert placeholder" in exported.stdout and "dropped 1 tensors" in exported.stdout, exported.stdout
        run(EXPORT + ["--vqgan", flax, "--out", work / "from-flax", "--image-size", 64])
        for folder in ("from-taming", "from-flax"):
            stored = load_file(str(work / folder / "model.safetensors"))
            assert sorted(stored) == sorted(state), (folder, sorted(set(stored) ^ set(state))[:5])
            for name, tensor in state.items():
                assert torch.equal(stored[name], tensor), (folder, name)
        config = (work / "from-flax" / "config.yaml").read_text()
        assert config == (work / "from-taming" / "config.yaml").read_text()
        for line in ("kind: vqgan", "  ch: 32", "  ch_mult: [1, 1, 1, 2, 2]", "  num_res_blocks: 2",
                     "  attn_resolutions: [4]", "  z_channels: 32", "  embed_dim: 32", "  n_embed: 128",
                     "  quantizer: vector", "  pixel_range: zero_to_one", "  level_attention: vqgan_jax_2021",
                     "  image_size: 64"):
            assert line + "\n" in config, (line, config)

        # What is not such a VQGAN is refused, by what it is.
        gumbel = work / "gumbel.ckpt"
        torch.save({"state_dict": dequantized(SOURCE / "tests" / "fixtures" / "vqgan_parity.safetensors")}, gumbel)
        refused = run(EXPORT + ["--vqgan", gumbel, "--out", work / "never"], expect_ok=False)
        assert "export_rudalle_vqgan.py" in refused.stderr, refused.stderr
        (work / "text.msgpack").write_text("not msgpack")
        refused = run(EXPORT + ["--vqgan", work / "text.msgpack", "--out", work / "never"], expect_ok=False)
        assert "not a msgpack file" in refused.stderr, refused.stderr
        assert not (work / "never").exists()

        # dalle-encode-images makes the reference's codes from the images' PNGs, in both ranges.
        dataset = work / "images"
        dataset.mkdir()
        for i, image in enumerate(fixture["images"]):
            write_png(dataset / f"{i}.png", image)
        (dataset / "captions.tsv").write_text("".join(f"{i}.png\ta picture number {i}\n"
                                                      for i in range(len(fixture["images"]))))
        run([TOOLS / "dalle-data", "compose", "--out", work / "fc", "--set", "train_images=4",
             "--set", "test_images=2", "--set", "heldout_images=0"])
        tokenizer = work / "tok.model"
        run([TOOLS / "dalle-tokenizer", "train", "--captions", work / "fc" / "train", "--out", tokenizer,
             "--set", "vocab_size=60", "--set", "text_length=12"])
        # The default is vqgan-jax's order of 2021-22, in which dalle-mini encoded Mega's images.
        tokens = encoded_tokens(work, work / "from-flax", dataset, tokenizer, "tokens")
        assert torch.equal(tokens, fixture["codes.vqgan_jax_2021"]), (tokens, fixture["codes.vqgan_jax_2021"])
        run(EXPORT + ["--vqgan", flax, "--out", work / "taming-order", "--image-size", 64,
                      "--level-attention", "taming"])
        assert "  level_attention: taming\n" in (work / "taming-order" / "config.yaml").read_text()
        tokens = encoded_tokens(work, work / "taming-order", dataset, tokenizer, "tokens-taming-order")
        assert torch.equal(tokens, fixture["codes"]), (tokens, fixture["codes"])
        run(EXPORT + ["--vqgan", flax, "--out", work / "taming-range", "--image-size", 64,
                      "--pixel-range", "minus_one_to_one", "--level-attention", "taming"])
        tokens = encoded_tokens(work, work / "taming-range", dataset, tokenizer, "tokens-taming-range")
        assert torch.equal(tokens, fixture["codes.minus_one_to_one"])

        # import-model mega --vqgan: the encoder beside the BART prior, its codes the detokenizer's.
        from import_mega_test import CODES, write_release
        release = work / "pretrained"
        write_release(release)
        import_model = [sys.executable, SOURCE / "scripts" / "import-model", "mega", "--from", release, "--heads", 4,
                        "--norm-groups", 4]
        refused = run(import_model + ["--codes", CODES, "--vqgan", flax, "--out", work / "mega"], expect_ok=False)
        assert f"has 128 codes, the detokenizer {CODES}" in refused.stderr, refused.stderr
        assert not (work / "mega").exists(), "a refused import writes nothing"
        fewer = {name: tensor[:CODES] if name == "quantize.embedding.weight" else tensor for name, tensor in state.items()}
        run(import_model + ["--codes", CODES, "--vqgan", write_flax_msgpack(work / "few.msgpack", fewer),
                            "--out", work / "mega"])
        encoder_config = (work / "mega" / "encoder" / "config.yaml").read_text()
        assert f"  n_embed: {CODES}\n" in encoder_config and "  level_attention: vqgan_jax_2021\n" in encoder_config
        generate_yaml = (work / "mega" / "generate.yaml").read_text()
        assert "\nencoder: encoder\n" in generate_yaml, generate_yaml
        generate = [TOOLS / "dalle-generate", "--model", work / "mega", "--threads", "1"]
        run(generate + ["--out", work / "drawn", "--candidates", "1", "a red sandal"])
        assert len(list((work / "drawn").glob("0000-*.json"))) == 1
        tokens = encoded_tokens(work, work / "mega" / "encoder", dataset, tokenizer, "tokens-mega")
        assert tokens.shape == (3, 16, 16) and int(tokens.max()) < CODES, tokens.shape

        # Image prompts: every image keeps the top rows of the picture's tokens under encoder/, the
        # rest drawn. The picture is 256 pixels, the encoder's side (16 x 16 tokens, the prior's
        # grid), so that the pipeline and dalle-encode-images both read it as it is.
        pictures = work / "picture"
        pictures.mkdir()
        write_png(pictures / "0.png", fixture["images"][0].repeat_interleave(4, 1).repeat_interleave(4, 2))
        (pictures / "captions.tsv").write_text("0.png\ta picture to continue\n")
        expected = encoded_tokens(work, work / "mega" / "encoder", pictures, tokenizer, "tokens-picture").reshape(-1)
        assert expected.numel() == 256, expected.shape
        prompted = generate + ["--candidates", "2", "--image-prompt", pictures / "0.png", "--image-prompt-rows", 4]
        run(prompted + ["--out", work / "continued", "a red sandal"])
        continued = [json.loads(path.read_text()) for path in sorted((work / "continued").glob("0000-*.json"))]
        assert len(continued) == 2, continued
        for image in continued:
            assert image["image_tokens"][:64] == expected[:64].tolist(), (image["image_tokens"][:64], expected[:64])
            assert len(image["image_tokens"]) == 256 and all(0 <= t < CODES for t in image["image_tokens"])
        assert continued[0]["image_tokens"][64:] != continued[1]["image_tokens"][64:], "the rows below are drawn"

        # Without the encoder key the folder refuses image prompts, saying what to set.
        (work / "mega" / "generate.yaml").write_text(generate_yaml.replace("encoder: encoder\n", ""))
        refused = run(prompted + ["--out", work / "never-drawn", "a red sandal"], expect_ok=False)
        assert "set encoder" in refused.stderr, refused.stderr
        (work / "mega" / "generate.yaml").write_text(generate_yaml)
    print("ImportModel.MegaVqganFromTamingOrFlaxEncodesTamingsCodes: passed")


if __name__ == "__main__":
    main()
