"""rudalle 1.1.3's own generation loop (rudalle.pipelines.generate_images) timed as
`dalle_bench_prior generation-xl` times ours: ruDALL-E Malevich's layout (24 layers x 2048,
random weights, built by the package's get_rudalle_model), the first 4 + N image tokens of
`--batch` images, the rate taken between the 4th and the last, and the peak resident memory.
Prints one JSON line (docs/benchmarks.md).

The loop is the package's, called as it is. The imports that it uses only after sampling, or
that current releases no longer have, are stubbed: transformers.top_k_top_p_filtering (gone
since transformers 4.39) by the same filtering written out, and torchvision, matplotlib,
PIL, tqdm, more_itertools and huggingface_hub by empty modules.

Environment: the rudalle venv of tests/parity/make_rudalle_prior_fixture.py.
    OMP_NUM_THREADS=2 ~/.cache/dalle/rudalle-venv/bin/python scripts/bench-rudalle-generation.py \
        --dtype float32 --batch 1
"""
import argparse
import importlib
import json
import resource
import sys
import time
import types

import torch


def stub(name, **attributes):
    module = types.ModuleType(name)
    module.__path__ = []
    for key, value in attributes.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


def top_k_top_p_filtering(logits, top_k=0, top_p=1.0, filter_value=-float("inf"), min_tokens_to_keep=1):
    """transformers 4.38's function, written out."""
    if top_k > 0:
        top_k = min(max(top_k, min_tokens_to_keep), logits.size(-1))
        logits = logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1, None], filter_value)
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., :min_tokens_to_keep] = False
        logits = logits.masked_fill(remove.scatter(1, sorted_indices, remove), filter_value)
    return logits


def chunked(iterable, n):
    items = list(iterable)
    return [items[i:i + n] for i in range(0, len(items), n)]


class EnoughTokens(Exception):
    pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32, help="image tokens timed after the first 4")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()

    stub("transformers", top_k_top_p_filtering=top_k_top_p_filtering)
    stub("more_itertools", chunked=chunked)
    stub("torchvision")
    stub("matplotlib")
    stub("matplotlib.pyplot")
    stub("PIL", Image=None)
    stub("PIL.Image")
    stub("tqdm", tqdm=lambda x, *a, **k: x)
    stub("tqdm.auto", tqdm=lambda x, *a, **k: x)
    stub("huggingface_hub", hf_hub_url=None, cached_download=None)
    spec = importlib.util.find_spec("rudalle")
    package = stub("rudalle")
    package.__path__ = list(spec.submodule_search_locations)
    dalle_package = importlib.import_module("rudalle.dalle")
    pipelines = importlib.import_module("rudalle.pipelines")

    torch.manual_seed(0)
    model = dalle_package.get_rudalle_model("Malevich", pretrained=False, fp16=False, device="cpu")
    model = model.to("cpu", getattr(torch, args.dtype)).eval()  # its own to() takes the device first
    parameters = sum(p.numel() for p in model.parameters())
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    untimed, calls, started = 4, [0], [0.0]
    forward = model.forward

    def counting_forward(*a, **k):
        # Call c (from 1) draws image token c; the rate runs from the end of call 4 to the last.
        if calls[0] == untimed:
            started[0] = time.perf_counter()
        if calls[0] == untimed + args.tokens:
            raise EnoughTokens
        calls[0] += 1
        return forward(*a, **k)

    model.forward = counting_forward
    text_length = model.get_param("text_seq_length")

    class RandomCaptions:
        def encode_text(self, text, text_seq_length):
            return torch.randint(4, 16384, (text_seq_length,))

    try:
        pipelines.generate_images("a caption", RandomCaptions(), model, None, top_k=2048, top_p=0.995,
                                  images_num=args.batch, bs=args.batch, use_cache=True)
    except EnoughTokens:
        pass
    seconds = time.perf_counter() - started[0]
    print(json.dumps({"benchmark": "generation-xl", "model": "rudalle 1.1.3 Malevich layout", "dtype": args.dtype,
                      "batch": args.batch, "parameters": parameters, "timed_tokens": args.tokens,
                      "image_tokens_per_s": args.batch * args.tokens / seconds,
                      "seconds_per_step": seconds / args.tokens, "text_length": text_length,
                      "peak_rss_mib_after_build": rss_built,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


main()
