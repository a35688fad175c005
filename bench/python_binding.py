#!/usr/bin/env python3
"""The cost of `import dalle`'s binding: the demo's generation from Python against dalle-generate,
in one sitting, alternating, each in a fresh process.

Usage: python_binding.py [--model models/fashion-compose] [--prompts 8] [--repeats 3] [--threads 2]
       (the project's venv; dalle built into build/, the package in build/python)

Each round runs dalle-generate --model MODEL --out DIR PROMPTS... and a Python process that loads
the same model with dalle.Pipeline, generates the same prompts and writes each PNG (the files
dalle-generate writes, byte for byte, but for its sidecars and grid). Both are timed whole, from
the process's start to its end; the Python process also reports how long `import dalle` took
(the interpreter and torch), which dalle-generate has no counterpart of. Prints one JSON line:
the medians, and the overhead of the binding = (python - import) / dalle-generate - 1 (goal:
within 2%).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

PROMPTS = ["a red bag on the left", "a blue sneaker at the top", "a white trouser on the left",
           "a green ankle boot at the top", "a yellow bag on the right", "a black coat on the left",
           "a pink dress at the bottom", "a grey shirt on the right"]

PYTHON_RUN = """
import sys, time
started = time.monotonic()
import dalle
imported = time.monotonic() - started
model, out, threads, *prompts = sys.argv[1:]
pipeline = dalle.Pipeline(model, threads=int(threads))
for index, images in enumerate(pipeline.generate(prompts)):
    for image in images:
        image.save(f"{out}/{index:04d}-{image.rank:02d}.png")
print(imported)
"""


def timed(command, env=None):
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"python_binding: {command[0]} failed:\n{result.stdout}{result.stderr}")
    return time.monotonic() - started, result.stdout


def main():
    here = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(here / "models" / "fashion-compose"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="2")
    parser.add_argument("--build", type=pathlib.Path, default=here / "build")
    args = parser.parse_args()
    prompts = PROMPTS[:args.prompts]
    env = dict(os.environ, PYTHONPATH=str(args.build / "python"))
    tool, python, imports = [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.repeats):
            out = pathlib.Path(scratch) / f"tool-{round_}"
            seconds, _ = timed([str(args.build / "tools" / "dalle-generate"), "--model", args.model, "--out", str(out),
                                "--threads", args.threads, *prompts])
            tool.append(seconds)
            out = pathlib.Path(scratch) / f"python-{round_}"
            out.mkdir()
            seconds, printed = timed([sys.executable, "-c", PYTHON_RUN, args.model, str(out), args.threads, *prompts],
                                     env)
            python.append(seconds)
            imports.append(float(printed.strip().splitlines()[-1]))
            same = all((out / name.name).read_bytes() == name.read_bytes()
                       for name in (pathlib.Path(scratch) / f"tool-{round_}").glob("*-*.png"))
            if not same:
                sys.exit("python_binding: the Python images differ from dalle-generate's")
    tool_s, python_s, import_s = (statistics.median(v) for v in (tool, python, imports))
    print(json.dumps({"test": "python_binding", "model": pathlib.Path(args.model).name, "prompts": len(prompts),
                      "threads": int(args.threads), "repeats": args.repeats,
                      "dalle_generate_s": round(tool_s, 3), "python_s": round(python_s, 3),
                      "import_dalle_s": round(import_s, 3),
                      "binding_overhead": round((python_s - import_s) / tool_s - 1, 4),
                      "same_pngs": True}))


if __name__ == "__main__":
    main()
