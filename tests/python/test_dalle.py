"""`import dalle` against the tools: pytest, run by ctest (Python.Package) with the project's
venv, PYTHONPATH at build/python, DALLE_SOURCE_DIR and DALLE_TOOLS_DIR set.

- The Python pipeline's PNGs are dalle-generate's, byte for byte, for the same prompts and seed.
- Tensors cross without a copy: a prior's parameter changed in place from Python changes the
  C++ model's output, and autograd reaches it.
- A training run from Python writes the tool's metrics lines; one stopped by Ctrl-C (SIGINT)
  raises KeyboardInterrupt after its checkpoint and resumes to the end.
- Bad input raises dalle.ConfigError / dalle.Error / ValueError with the library's message.
- Two Python threads generate with two pipelines at once, and a third runs meanwhile.
- dalle.plan is dalle-plan --json.
"""
import json
import os
import pathlib
import signal
import subprocess
import threading
import time

import pytest
import torch

import dalle

SOURCE = pathlib.Path(os.environ["DALLE_SOURCE_DIR"])
TOOLS = pathlib.Path(os.environ["DALLE_TOOLS_DIR"])
MODEL = SOURCE / "models" / "fashion-compose-f8"
PROMPTS = ["a red bag on the left", "a blue sneaker at the top"]


def run_tool(*arguments, cwd=None):
    result = subprocess.run([str(TOOLS / arguments[0]), *map(str, arguments[1:])], capture_output=True, text=True,
                            timeout=600, cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def pipeline():
    return dalle.Pipeline(MODEL, threads=1)


def test_images_are_dalle_generates_byte_for_byte(pipeline, tmp_path):
    images = pipeline.generate(PROMPTS, n=2, seed=7)
    run_tool("dalle-generate", "--model", MODEL, "--out", tmp_path, "-n", 2, "--seed", 7, "--threads", 1, *PROMPTS)
    assert [len(of_prompt) for of_prompt in images] == [2, 2]
    for index, of_prompt in enumerate(images):
        for rank, image in enumerate(of_prompt):
            assert image.rank == rank and image.prompt == PROMPTS[index] and image.seed == 7
            assert image.png == (tmp_path / f"{index:04d}-{rank:02d}.png").read_bytes(), (index, rank)
            assert image.metadata == json.loads((tmp_path / f"{index:04d}-{rank:02d}.json").read_text())
    picture = images[0][0].image
    side = pipeline.image_size(superres=True)
    assert picture.size == (side, side) and picture.mode == "RGB"
    assert images[0][0].tensor.shape == (3, side, side) and images[0][0].tensor.dtype == torch.float32
    # One prompt alone: its images, the first prompt's of the same call.
    alone = pipeline.generate(PROMPTS[0], n=2, seed=7)
    assert [image.png for image in alone] == [image.png for image in images[0]]


def test_previews_show_the_candidates_as_drawn(pipeline):
    shown = []
    images = pipeline.generate(PROMPTS[0], n=1, candidates=2, seed=3, superres=False, on_preview=shown.extend,
                               preview_every=16)
    drawn = sorted({preview.drawn for preview in shown})
    assert drawn == [16, 32, 48, 64] and {preview.candidate for preview in shown} == {0, 1}
    last = [p for p in shown if p.drawn == 64 and p.candidate == images[0].candidate][0]
    assert torch.equal(last.tokens, images[0].tokens), "the last preview is the image's tokens"
    assert last.image.size == (64, 64)

    def failing(_):
        raise RuntimeError("from the callback")

    with pytest.raises(RuntimeError, match="from the callback"):
        pipeline.generate(PROMPTS[0], n=1, candidates=2, superres=False, on_preview=failing)


def test_a_priors_tensors_are_shared_not_copied():
    prior = dalle.load_prior(MODEL / "prior")
    length = int(prior.config["text_length"]) + int(prior.config["grid_size"]) ** 2
    tokens = torch.zeros(1, length, dtype=torch.int64)
    tokens[0, 0] = 2
    with torch.no_grad():
        before = prior(tokens)
    parameters = prior.named_parameters()
    name = next(key for key in parameters if key.endswith("qkv.weight"))
    assert parameters[name].data_ptr() == prior.named_parameters()[name].data_ptr(), "the same storage each time"
    with torch.no_grad():
        parameters[name].mul_(0.5)  # in place, from Python: the C++ model sees it
        after = prior(tokens)
    assert not torch.equal(before, after)
    prior.train()
    loss = prior(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert parameters[name].grad is not None and parameters[name].grad.abs().sum() > 0, "autograd reaches it"


@pytest.fixture(scope="module")
def images_dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    run_tool("dalle-data", "compose", "--out", folder / "fc", "--set", "train_images=32", "--set", "test_images=8",
             "--set", "heldout_images=0")
    return folder / "fc"


def vae_overrides(dataset, steps):
    return {"data": {"train": str(dataset / "train"), "validation": str(dataset / "test"), "image_size": 16,
                     "batch_size": 8},
            "model": {"hidden": 8, "decoder_init": 8, "groups": 2, "downsamplings": 1, "blocks_per_group": 1,
                      "vocab_size": 32},
            "run": {"steps": steps, "log_every": 1, "validate_every": 1000, "checkpoint_every": 1000}}


def comparable(line):
    """A metrics line without what depends on the clock."""
    return {key: value for key, value in json.loads(line).items()
            if not any(word in key for word in ("second", "time", "per_s", "eta"))}


def test_training_writes_the_tools_metrics(images_dataset, tmp_path):
    overrides = vae_overrides(images_dataset, 3)
    lines = []
    result = dalle.train(None, tmp_path / "python", trainer="vae", overrides=overrides, on_metrics=lines.append)
    assert result["finished"]
    command = ["dalle-train-vae", "--out", tmp_path / "tool"]
    for assignment in dalle._config.assignments(overrides):
        command += ["--set", assignment]
    run_tool(*command)
    ours = (tmp_path / "python" / "metrics.jsonl").read_text().splitlines()
    tools = (tmp_path / "tool" / "metrics.jsonl").read_text().splitlines()
    assert ours and [comparable(line) for line in ours] == [comparable(line) for line in tools]
    assert [comparable(json.dumps(line)) for line in lines] == [comparable(line) for line in ours]


def test_ctrl_c_writes_a_checkpoint_and_the_run_resumes(images_dataset, tmp_path):
    overrides = vae_overrides(images_dataset, 400)
    interrupted = []

    def interrupt_once(line):
        if not interrupted:
            interrupted.append(line["step"])
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt, match="a checkpoint is in"):
        dalle.train(None, tmp_path / "run", trainer="vae", overrides=overrides, on_metrics=interrupt_once,
                    poll_seconds=0.05)
    checkpoints = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints, "the stop wrote a checkpoint"
    stopped_at = int(checkpoints[-1].name.split("-")[-1])
    assert interrupted[0] <= stopped_at < 400
    overrides["run"]["steps"] = stopped_at + 2
    assert dalle.train(None, tmp_path / "run", trainer="vae", overrides=overrides)["finished"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == stopped_at + 2


def test_bad_input_raises_with_the_librarys_message(pipeline):
    with pytest.raises(dalle.ConfigError, match="candidate") as raised:
        dalle.Pipeline(MODEL, candidate=4)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, dalle.Error)
    with pytest.raises(dalle.Error, match="absent"):
        dalle.Pipeline(MODEL, prior=str(MODEL / "absent"))
    with pytest.raises(ValueError, match="n must be"):
        pipeline.generate(PROMPTS[0], n=0)
    with pytest.raises(ValueError, match="fewer than n"):
        pipeline.generate(PROMPTS[0], n=3, candidates=2)
    with pytest.raises(dalle.Error, match="this pipeline has none"):
        pipeline.generate(PROMPTS[0], adapters=["style"])
    with pytest.raises(dalle.Error, match="the prompt is blank"):
        pipeline.generate(" ")
    with pytest.raises(ValueError, match="trainer must be"):
        dalle.train(None, "out", trainer="gan")
    with pytest.raises(dalle.ConfigError, match="model.width"):
        dalle.plan(overrides={"model.width": -1})


def test_two_threads_generate_at_once_and_others_run(pipeline):
    other = dalle.Pipeline(MODEL, threads=1)
    results, ticks = {}, []
    done = threading.Event()

    def draw(name, which):
        results[name] = which.generate(PROMPTS, n=1, candidates=4, seed=5, superres=False)

    def tick():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    threads = [threading.Thread(target=draw, args=("a", pipeline)), threading.Thread(target=draw, args=("b", other))]
    ticker = threading.Thread(target=tick)
    ticker.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    done.set()
    ticker.join()
    assert set(results) == {"a", "b"}
    assert [[i.png for i in p] for p in results["a"]] == [[i.png for i in p] for p in results["b"]]
    assert len(ticks) > 10, "the GIL was released while they drew"


def test_plan_is_dalle_plans_json():
    config = SOURCE / "configs" / "prior" / "dalle-12b.yaml"
    cluster = {"nodes": 128, "gpus_per_node": 8, "gpu_memory": 16, "peak_tflops": 125}
    ours = dalle.plan(config, **cluster)
    tools = json.loads(run_tool("dalle-plan", "--config", config, "--nodes", 128, "--gpus-per-node", 8,
                                "--gpu-memory", 16, "--peak-tflops", 125, "--json"))
    assert ours == tools
    assert isinstance(ours["memory"]["fits"], bool)
