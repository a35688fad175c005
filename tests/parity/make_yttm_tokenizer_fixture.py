"""Identity fixture for ruDALL-E's caption tokenizer (src/text/yttm_tokenizer.cpp) against
the `youtokentome` package (PyPI 1.0.6) and rudalle 1.1.3's `YTTMTokenizerWrapper`.

ruDALL-E's released bpe.model is not ours to commit, so the fixture carries a small
YouTokenToMe model learnt here by the package itself from a synthetic Russian and English
caption corpus (tests/fixtures/yttm_bpe.model), and, for 4000 other captions, the ids the
package gives (tests/fixtures/yttm_tokenizer.json.gz):
* `encode`: `BPE.encode([text], output_type=ID)[0]`, the text as it is;
* `caption_ids`: what rudalle's generate_images feeds its model: `text.lower().strip()`,
  then `YTTMTokenizerWrapper.encode_text(text, text_seq_length=TEXT_LENGTH)` (BOS, ids, EOS,
  zero padding, cut to the length).
The captions mix both alphabets, upper case, digits, punctuation, runs of spaces and tabs,
leading and trailing white space, characters the model never saw (emoji, CJK, Greek, and
rare Cyrillic letters dropped by the model's character coverage), U+2581 itself, and
captions longer than TEXT_LENGTH.

Environment: the rudalle venv of make_rudalle_prior_fixture.py, plus youtokentome, which
builds from source:
    ~/.cache/dalle/rudalle-venv/bin/pip install Cython wheel setuptools
    ~/.cache/dalle/rudalle-venv/bin/pip install --no-build-isolation youtokentome==1.0.6
    ~/.cache/dalle/rudalle-venv/bin/python tests/parity/make_yttm_tokenizer_fixture.py
"""
import gzip
import importlib.util
import json
import pathlib
import random
import sys
import tempfile
import types

import youtokentome as yttm

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures"
TEXT_LENGTH = 32
VOCAB_SIZE = 600


def rudalle_wrapper():
    """rudalle/tokenizer.py, imported alone: it needs huggingface_hub only for downloads."""
    spec = importlib.util.find_spec("rudalle")
    if spec is None:
        sys.exit("rudalle is not installed in this interpreter (see the docstring)")
    hub = types.ModuleType("huggingface_hub")
    hub.hf_hub_url = hub.cached_download = None
    sys.modules.setdefault("huggingface_hub", hub)
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "tokenizer.py"
    module_spec = importlib.util.spec_from_file_location("rudalle_tokenizer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.YTTMTokenizerWrapper


RUSSIAN = ("красная сумка слева синие кроссовки справа белые брюки сверху зелёный ботинок внизу "
           "жёлтое платье рубашка кошка собака дом река небо солнце лес картина маслом портрет "
           "девушка в шляпе чёрный кот на окне зимний город ночью море и корабль горы озеро "
           "фотография цветы в вазе натюрморт яблоко груша стол стул лампа книга").split()
ENGLISH = ("a red bag on the left blue sneakers on the right white trousers at the top green boot "
           "at the bottom yellow dress shirt cat dog house river sky sun forest oil painting "
           "portrait of a girl in a hat black cat on the window winter city at night sea and ship "
           "mountains lake photo flowers in a vase still life apple pear table chair lamp book").split()
RARE = list("ѢѣѲѳѴѵІіЇїЄєҐґ")          # old and Ukrainian letters: few in training, some dropped
UNSEEN = ["😀", "👕", "猫", "写真", "αβγ", "Ωμέγα", "№", "€", "§", "\u2581", "ß", "ﬁ"]
PUNCTUATION = list(".,!?;:-()\"'«»…")


def caption(rng, words):
    n = rng.randint(1, 14)
    out = []
    for _ in range(n):
        w = rng.choice(words)
        r = rng.random()
        if r < 0.15:
            w = w.capitalize()
        elif r < 0.2:
            w = w.upper()
        if rng.random() < 0.1:
            w += rng.choice(PUNCTUATION)
        if rng.random() < 0.05:
            w = str(rng.randint(0, 2024)) + (" " if rng.random() < 0.5 else "") + w
        out.append(w)
    return " ".join(out)


def training_corpus(rng):
    lines = []
    for _ in range(6000):
        words = rng.choice([RUSSIAN, ENGLISH, RUSSIAN + ENGLISH])
        text = caption(rng, words)
        if rng.random() < 0.02:
            text += " " + rng.choice(RARE[:6])
        lines.append(text)
    return lines


def test_caption(rng):
    words = rng.choice([RUSSIAN, ENGLISH, RUSSIAN + ENGLISH])
    text = caption(rng, words)
    r = rng.random()
    if r < 0.15:
        i = rng.randint(0, len(text))
        text = text[:i] + rng.choice(UNSEEN + RARE) + text[i:]
    elif r < 0.25:
        text = text.replace(" ", rng.choice(["  ", "\t", " \t ", "   "]), rng.randint(1, 3))
    elif r < 0.32:
        text = rng.choice([" ", "  ", "\t", "\n "]) + text + rng.choice([" ", "  ", "\t", " \n"])
    elif r < 0.37:
        text = " ".join([text] * rng.randint(3, 6))   # longer than TEXT_LENGTH
    return text


def main():
    rng = random.Random(20261125)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = pathlib.Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(training_corpus(rng)) + "\n", encoding="utf-8")
        model = FIXTURES / "yttm_bpe.model"
        yttm.BPE.train(data=str(corpus), model=str(model), vocab_size=VOCAB_SIZE, coverage=0.9995, n_threads=1,
                       pad_id=0, unk_id=1, bos_id=2, eos_id=3)
    bpe = yttm.BPE(model=str(model))
    wrapper = rudalle_wrapper()(bpe)
    texts = ["", " ", "\t\n", "\u2581", "ЁЛКА ёлка Ёж", "İstanbul ΣΟΦΙΑ"] + [test_caption(rng) for _ in range(3994)]
    encode = [bpe.encode([t], output_type=yttm.OutputType.ID)[0] for t in texts]
    caption_ids = [wrapper.encode_text(t.lower().strip(), text_seq_length=TEXT_LENGTH).tolist() for t in texts]
    unknown = sum(1 for ids in encode if 1 in ids)
    cut = sum(1 for ids in encode if len(ids) + 2 > TEXT_LENGTH)
    out = FIXTURES / "yttm_tokenizer.json.gz"
    payload = json.dumps({"vocab_size": bpe.vocab_size(), "text_length": TEXT_LENGTH, "texts": texts,
                          "encode": encode, "caption_ids": caption_ids}, ensure_ascii=False, separators=(",", ":"))
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as packed:
        packed.write(payload.encode("utf-8") + b"\n")  # no name or time in the header: reproducible
    print(f"wrote {model} ({model.stat().st_size} bytes) and {out} ({out.stat().st_size} bytes): "
          f"{len(texts)} texts, {unknown} with unknown characters, {cut} cut to {TEXT_LENGTH}")


main()
