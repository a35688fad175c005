#!/usr/bin/env python3
"""ImportModel: scripts/import-model rudalle turns a folder of ruDALL-E's released files
into a model folder that dalle-generate --model runs as it is, and import-model clip adds
ruCLIP reranking to it from a folder of ruCLIP's released files.

Usage: import_model_test.py SOURCE_DIR TOOLS_DIR  (ctest runs it with the project's venv)

The released files are stand-ins at a small layout, written under their released names:
a ruDALL-E transformer state dict with random weights (pytorch_model_v3.bin, fp16 as
released, with its mask buffers), the VQGAN and x2 Real-ESRGAN of the parity fixtures
(tests/fixtures, dequantized) in a Lightning-style checkpoint and a bare state dict, and the
YouTokenToMe fixture model as bpe.model. ruCLIP's folder holds the ruclip parity fixture's
CLIP (tests/parity/make_ruclip_fixture.py) as pytorch_model.bin, its sizes as config.json
under ruclip's keys, and the YouTokenToMe fixture model as its bpe.model.
"""
import json
import pathlib
import sys
import tempfile

import torch
from safetensors.torch import load_file

from release_files import dequantized, run

SOURCE, TOOLS = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
FIXTURES = SOURCE / "tests" / "fixtures"
WIDTH, LAYERS, TEXT_LENGTH, GRID, IMAGE_VOCAB = 32, 2, 8, 8, 64
TEXT_VOCAB = 600  # the YouTokenToMe fixture's ids


def rudalle_state():
    generator = torch.Generator().manual_seed(0)
    vocab = TEXT_VOCAB + TEXT_LENGTH
    shapes = {"text_embeddings.weight": [vocab, WIDTH], "text_pos_embeddings.weight": [TEXT_LENGTH + 1, WIDTH],
              "image_embeddings.weight": [IMAGE_VOCAB, WIDTH], "image_row_embeddings.weight": [GRID, WIDTH],
              "image_col_embeddings.weight": [GRID, WIDTH], "to_logits.1.weight": [vocab + IMAGE_VOCAB, WIDTH],
              "to_logits.1.bias": [vocab + IMAGE_VOCAB]}
    for norm in ("transformer.final_layernorm", "to_logits.0"):
        shapes.update({f"{norm}.weight": [WIDTH], f"{norm}.bias": [WIDTH]})
    for layer in range(LAYERS):
        at = f"transformer.layers.{layer}."
        for norm in ("input_layernorm", "before_first_addition_layernorm", "post_attention_layernorm",
                     "before_second_addition_layernorm"):
            shapes.update({f"{at}{norm}.weight": [WIDTH], f"{at}{norm}.bias": [WIDTH]})
        for name, (rows, columns) in {"attention.query_key_value": (3 * WIDTH, WIDTH),
                                      "attention.dense": (WIDTH, WIDTH), "mlp.dense_h_to_4h": (4 * WIDTH, WIDTH),
                                      "mlp.dense_4h_to_h": (WIDTH, 4 * WIDTH)}.items():
            shapes.update({f"{at}{name}.weight": [rows, columns], f"{at}{name}.bias": [rows]})
    state = {name: (0.1 * torch.randn(shape, generator=generator)).half() for name, shape in shapes.items()}
    length = TEXT_LENGTH + GRID * GRID
    for mask in ("row_mask", "col_mask", "conv_mask"):
        state[f"transformer.{mask}"] = torch.ones(1, 1, length, length)
    return state


def write_release(folder):
    torch.save(rudalle_state(), folder / "pytorch_model_v3.bin")
    vqgan = {name: tensor for name, tensor in dequantized(FIXTURES / "vqgan_parity.safetensors").items()
             if name.startswith(("encoder.", "decoder.", "quantize.", "quant_conv.", "post_quant_conv."))}
    vqgan["loss.discriminator.main.0.weight"] = torch.zeros(2, 3, 4, 4)  # taming's extras, dropped
    torch.save({"state_dict": vqgan, "epoch": 3}, folder / "vqgan.gumbelf8-sber.model.ckpt")
    torch.save(dequantized(FIXTURES / "rrdbnet_parity.safetensors", "x2."), folder / "RealESRGAN_x2.pth")
    (folder / "bpe.model").write_bytes((FIXTURES / "yttm_bpe.model").read_bytes())


RUCLIP_KEYS = ("embed_dim", "image_resolution", "vision_layers", "vision_width", "vision_patch_size",
               "context_length", "vocab_size", "transformer_width", "transformer_heads", "transformer_layers")


def write_ruclip_release(folder):
    fixture = FIXTURES / "ruclip_parity.safetensors"
    folder.mkdir()
    torch.save(dequantized(fixture), folder / "pytorch_model.bin")
    with open(fixture, "rb") as f:  # the sizes are in the fixture's metadata
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    (folder / "config.json").write_text(json.dumps({key: int(header[key]) for key in RUCLIP_KEYS}))
    (folder / "bpe.model").write_bytes((FIXTURES / "yttm_bpe.model").read_bytes())


def add_ruclip(work, model, images, generate):
    """ruCLIP added to the ruDALL-E folder reranks its candidates, the prompt in ruclip's templates."""
    release = work / "ruclip-vit-test"
    write_ruclip_release(release)
    add_clip = [sys.executable, SOURCE / "scripts" / "import-model", "clip", "--from", release, "--into", model]

    # A missing file is named, and the folder is left as it was.
    (release / "bpe.model").rename(work / "ruclip-bpe.model")
    before = (model / "generate.yaml").read_text(encoding="utf-8")
    refused = run(add_clip, expect_ok=False)
    assert "bpe.model" in refused.stderr and "nothing was written" in refused.stderr, refused.stderr
    assert not (model / "clip").exists() and (model / "generate.yaml").read_text(encoding="utf-8") == before
    (work / "ruclip-bpe.model").rename(release / "bpe.model")

    run(add_clip)
    config = (model / "clip" / "config.yaml").read_text()
    for line in ("vision_heads: 1", "text_heads: 4", "context_length: 16", "vocab_size: 600", "image_size: 32",
                 "activation: quick_gelu", "text_pooling: eos", "eos_id: 3", "preprocess: ruclip"):
        assert f"  {line}\n" in config, f"ruCLIP config lacks '{line}':\n{config}"
    folder = (model / "generate.yaml").read_text(encoding="utf-8")
    # rudalle's README keeps 6 of its 24 (cherry_pick_by_ruclip's count).
    for line in ("clip: clip", "clip_tokenizer: clip-bpe.model", "keep: 6", 'clip_templates: ["{}", "фото, на котором'):
        assert line in folder, f"generate.yaml lacks '{line}':\n{folder}"
    assert (model / "clip-bpe.model").read_bytes() == (FIXTURES / "yttm_bpe.model").read_bytes()
    assert (model / "bpe.model").is_file(), "ruDALL-E's own tokenizer stays"

    prompt = "Радуга на фоне ночного города"
    run(generate + ["--out", images / "all", "--candidates", "4", "-n", "4", prompt])
    every = [json.loads(path.read_text(encoding="utf-8")) for path in sorted((images / "all").glob("0000-*.json"))]
    scores = [image["clip_score"] for image in every]
    assert len(every) == 4 and all(isinstance(score, float) for score in scores), scores
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 4, scores
    assert "на фото видно {}" in every[0]["pipeline"]["clip_templates"], every[0]["pipeline"]
    run(generate + ["--out", images / "kept", "--candidates", "4", "-n", "2", prompt])
    kept = [json.loads(path.read_text(encoding="utf-8")) for path in sorted((images / "kept").glob("0000-*.json"))]
    assert [image["image_tokens"] for image in kept] == [image["image_tokens"] for image in every[:2]], \
        "the best 2 of the same 4 candidates"
    again = run(add_clip, expect_ok=False)
    assert "reranks already" in again.stderr, again.stderr


def main():
    import_model = [sys.executable, SOURCE / "scripts" / "import-model", "rudalle", "--heads", 4]
    with tempfile.TemporaryDirectory() as work:
        work = pathlib.Path(work)
        release, model, images = work / "release", work / "models" / "rudalle", work / "images"
        release.mkdir()
        write_release(release)

        # A missing file is named, and nothing is left behind.
        (release / "bpe.model").rename(work / "bpe.model")
        refused = run(import_model + ["--from", release, "--out", model, "--image-size", 16], expect_ok=False)
        assert "bpe.model" in refused.stdout + refused.stderr, refused.stderr
        assert not (work / "models").exists() or not any((work / "models").iterdir()), "a refused import left files"
        (work / "bpe.model").rename(release / "bpe.model")

        run(import_model + ["--from", release, "--out", model, "--image-size", 16])
        config = (model / "prior" / "config.yaml").read_text()
        for line in ("layers: 2", "width: 32", f"text_vocab_size: {TEXT_VOCAB}", f"text_length: {TEXT_LENGTH}",
                     f"grid_size: {GRID}", "layer_pattern: rudalle"):
            assert f"  {line}\n" in config, f"prior config lacks '{line}':\n{config}"
        assert not any(name.endswith("_mask") for name in load_file(str(model / "prior" / "model.safetensors")))

        again = run(import_model + ["--from", release, "--out", model, "--image-size", 16], expect_ok=False)
        assert "exists" in again.stderr, again.stderr

        run([TOOLS / "dalle-generate", "--model", model, "--out", images, "--candidates", "4", "--threads", "1",
             "радуга на фоне ночного города"])
        sidecars = sorted(images.glob("0000-*.json"))
        assert len(sidecars) == 4, sorted(images.iterdir())
        drawn = [json.loads(path.read_text()) for path in sidecars]
        # 4 candidates over 8 stages take every second stage: top_k 2048, 1024, 512, 256.
        assert sorted(image["top_k"] for image in drawn) == [256, 512, 1024, 2048], [d["top_k"] for d in drawn]
        assert all(image["size"] == [32, 32] for image in drawn), "16-pixel images upscaled x2"

        # A filter on the command line replaces the folder's schedule.
        run([TOOLS / "dalle-generate", "--model", model, "--out", images, "--candidates", "2", "--threads", "1", "--top-k", 5,
             "радуга"])
        drawn = [json.loads(path.read_text()) for path in sorted(images.glob("0000-*.json"))]
        assert [image["top_k"] for image in drawn] == [5, 5], [image["top_k"] for image in drawn]

        generate = [TOOLS / "dalle-generate", "--model", model, "--threads", "1"]
        add_ruclip(work, model, work / "reranked", generate)
    print("ImportModel.RudalleFolderGeneratesWithItsSchedule: passed")


if __name__ == "__main__":
    main()
