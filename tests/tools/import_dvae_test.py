#!/usr/bin/env python3
"""ImportModel: scripts/import-model dvae turns OpenAI's released dVAE pickles into a
checkpoint that dalle-encode-images runs, without the dall-e package installed.

Usage: import_dvae_test.py SOURCE_DIR TOOLS_DIR  (ctest runs it with the project's venv)

The release's encoder.pkl and decoder.pkl are whole pickled modules of the `dall-e` package.
They are stood in for here by modules of a small package also named dall_e, written to a
scratch folder, holding the weights of tests/fixtures/dvae_parity.safetensors (the dall-e
package's own modules with random weights) under the release's names and the sizes as
attributes, pickled by torch.save in a process that imports it; the import then runs where
no dall_e can be imported. DvaeParity.* shows that these names and values reproduce
dall-e's encoder and decoder.
"""
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

from release_files import run

SOURCE, TOOLS = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
FIXTURE = SOURCE / "tests" / "fixtures" / "dvae_parity.safetensors"
SIZES = {"encoder": "input_channels=3, n_hid=16, group_count=4, n_blk_per_group=2, vocab_size=64",
         "decoder": "output_channels=3, n_init=8, n_hid=16, group_count=4, n_blk_per_group=2, vocab_size=64"}

STAND_IN = {
    "__init__.py": "",
    "utils.py": '''
import torch


class Conv2d(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(w), torch.nn.Parameter(b)


def build(root, state, block_class):
    """Submodules of `root` holding `state`'s tensors under their dotted names."""
    for name in sorted(state):
        if not name.endswith(".w"):
            continue
        *path, leaf = name[:-2].split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, block_class() if part.startswith("block_") else torch.nn.Module())
            module = getattr(module, part)
        module.add_module(leaf, Conv2d(state[name[:-2] + ".w"], state[name[:-2] + ".b"]))
''',
}
for kind in ("encoder", "decoder"):
    STAND_IN[f"{kind}.py"] = f'''
import torch

from .utils import build


class {kind.capitalize()}Block(torch.nn.Module):
    pass


class {kind.capitalize()}(torch.nn.Module):
    def __init__(self, state, **sizes):
        super().__init__()
        for size, value in sizes.items():
            setattr(self, size, value)
        build(self, state, {kind.capitalize()}Block)
'''


def write_release(work, fixture):
    package = work / "stand-in" / "dall_e"
    package.mkdir(parents=True)
    for name, text in STAND_IN.items():
        (package / name).write_text(text)
    release = work / "release"
    release.mkdir()
    for kind in ("encoder", "decoder"):
        state = {name[len(kind) + 1:]: tensor for name, tensor in fixture.items() if name.startswith(kind + ".")}
        torch.save(state, work / f"{kind}-state.pt")
        script = (f"import torch\nfrom dall_e.{kind} import {kind.capitalize()}\n"
                  f"state = torch.load({str(work / f'{kind}-state.pt')!r})\n"
                  f"torch.save({kind.capitalize()}(state, {SIZES[kind]}), {str(release / f'{kind}.pkl')!r})\n")
        subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": str(package.parent)})
    return release


def main():
    fixture = {name: tensor for name, tensor in load_file(str(FIXTURE)).items()
               if name.startswith(("encoder.", "decoder."))}
    import_model = [sys.executable, SOURCE / "scripts" / "import-model", "dvae"]
    with tempfile.TemporaryDirectory() as scratch:
        work = pathlib.Path(scratch)
        release = write_release(work, fixture)
        assert subprocess.run([sys.executable, "-c", "import dall_e"], capture_output=True).returncode != 0, \
            "the import must run where the dall-e package cannot be imported"

        empty = work / "empty"
        empty.mkdir()
        refused = run(import_model + ["--from", empty, "--out", work / "never"], expect_ok=False)
        assert "no dVAE encoder (expected encoder.pkl)" in refused.stdout + refused.stderr, refused
        assert not (work / "never").exists(), "a refused import writes nothing"

        checkpoint = work / "openai-dvae"
        run(import_model + ["--from", release, "--out", checkpoint, "--image-size", 64])
        stored = load_file(str(checkpoint / "model.safetensors"))
        assert sorted(stored) == sorted(fixture), sorted(set(stored) ^ set(fixture))
        for name, tensor in fixture.items():
            assert torch.equal(stored[name], tensor.float()), name
        config = (checkpoint / "config.yaml").read_text()
        for line in ("hidden: 16", "decoder_init: 8", "groups: 4", "blocks_per_group: 2", "downsamplings: 3",
                     "vocab_size: 64", "image_size: 64"):
            assert line in config, (line, config)
        refused = run(import_model + ["--from", release, "--out", checkpoint], expect_ok=False)
        assert "exists" in refused.stdout + refused.stderr

        # The C++ side reads it: images of 64 pixels become 8x8 grids of its 64 codes.
        run([TOOLS / "dalle-data", "compose", "--out", work / "fc", "--set", "train_images=4",
             "--set", "test_images=2", "--set", "heldout_images=0"])
        run([TOOLS / "dalle-tokenizer", "train", "--captions", work / "fc" / "train", "--out", work / "tok.model",
             "--set", "vocab_size=60", "--set", "text_length=12"])
        encoded = run([TOOLS / "dalle-encode-images", "--dataset", work / "fc" / "test", "--dvae", checkpoint,
                       "--tokenizer", work / "tok.model", "--out", work / "tokens"])
        assert any((work / "tokens").iterdir()), encoded.stdout + encoded.stderr
    print("import-model dvae: the release's tensors and sizes, read without dall-e, encode images")


if __name__ == "__main__":
    main()
