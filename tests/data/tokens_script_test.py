#!/usr/bin/env python3
"""scripts/tokens.py against the C++ reader (twobp::data::read_token_file, through tests/data/token_file_probe).

Usage: tokens_script_test.py wide|tokenizer PROBE WORK_DIR [LLAMA_PIPELINE]

wide       (standard library only) text and .npy ids become 16-bit files (version 1) when the vocabulary fits and
           32-bit ones (version 2) when it does not (ids up to Llama 3's 128,255) or when --bits 32 asks; the reader
           gives back the ids written; a model with a smaller vocabulary, a header width of 24 bits, truncated data
           and a token beyond the vocabulary are refused with one error naming the file and what was expected;
           given LLAMA_PIPELINE, the example trains 2 steps on a 32-bit file (--vocab 70000, --pack).
tokenizer  (needs the package `tokenizers`; exits 77, ctest's skip, saying so when it is missing) trains a small
           byte-level BPE tokenizer here (vocabulary > 256), converts text with --tokenizer, and the reader gives back
           exactly tokenizer.encode(text).ids, in 16 bits, and in 32 bits with --vocab 70000 or --bits 32.
"""
import array
import importlib.util
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = os.path.join(HERE, "..", "..", "scripts", "tokens.py")
SKIP = 77

TEXT = """The orchard stands at the bottom of the hill, where the ground is wet in spring.
There are eleven apple trees, three pears, a plum that leans toward the road, and a quince.
A good pruner walks around a tree twice before making the first cut.
The saw must be sharp and the ladder must be steady; a steady ladder stands on three feet.
In summer the fruit swells, and the branches bend under the weight of what they carry.
Pipelines of stages pass activations forward and gradients backward, micro-batch after micro-batch.
Two-stage backpropagation splits the backward pass: input gradients first, weight gradients later.
Caf\u00e9 au lait, na\u00efve r\u00e9sum\u00e9s, and other words with accents keep their bytes.
Numbers too: 128256 tokens in a vocabulary, 65536 in sixteen bits, 4294967295 in thirty-two.
"""


def run(args, expect_ok=True, must_say=None):
    p = subprocess.run(args, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    if expect_ok and p.returncode != 0:
        sys.exit(f"FAILED (status {p.returncode}): {' '.join(args)}\n{out}")
    if not expect_ok and p.returncode == 0:
        sys.exit(f"FAILED: accepted {' '.join(args)}\n{out}")
    for needle in ([must_say] if isinstance(must_say, str) else must_say or []):
        if needle not in out:
            sys.exit(f"FAILED: {' '.join(args)} does not say {needle!r}:\n{out}")
    return out


def header(path):
    """(version, vocab, token bits, count) of a token file, read here from the bytes (data.h's table)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"TWOBPTOK", f"{path}: no header"
    version, vocab, n = struct.unpack("<IIQ", data[8:24])
    bits = struct.unpack("<I", data[24:28])[0] if version == 2 else 16
    size = (24 if version == 1 else 32) + bits // 8 * n
    assert len(data) == size, f"{path}: {len(data)} bytes, the header says {size}"
    return version, vocab, bits, n


class Reader:
    """The C++ reader, through the probe."""

    def __init__(self, probe):
        self.probe = probe

    def tokens(self, path, vocab):
        out = run([self.probe, path, str(vocab)]).split("\n")[0]
        count, _, ids = out.partition(" tokens:")
        ids = [int(t) for t in ids.split()]
        assert int(count) == len(ids), out[:200]
        return ids

    def refuses(self, path, vocab, *needles):
        run([self.probe, path, str(vocab)], expect_ok=False, must_say=[path, *needles])


def npy_writer():
    """tests/programs/tokens_test.py's hand-written .npy (no NumPy needed): one writer of the format for both tests."""
    spec = importlib.util.spec_from_file_location("tokens_test", os.path.join(HERE, "..", "programs", "tokens_test.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.npy


def check_wide(reader, work, example=None):
    conv = [sys.executable, TOKENS]
    text = os.path.join(work, "corpus.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write(TEXT)
    raw = open(text, "rb").read()
    # Bytes, through the default command: version 1, 16 bits, as twobp 0.2 wrote them.
    out = os.path.join(work, "bytes.tok")
    run(conv + [text, out], must_say="16-bit")
    assert header(out) == (1, 256, 16, len(raw)), header(out)
    assert reader.tokens(out, 256) == list(raw)
    # The same bytes declared with a vocabulary beyond 16 bits: version 2, 32 bits.
    out = os.path.join(work, "bytes32.tok")
    run(conv + ["text", text, out, "--vocab", "70000"], must_say="32-bit")
    assert header(out) == (2, 70000, 32, len(raw)), header(out)
    assert reader.tokens(out, 70000) == list(raw)
    reader.refuses(out, 65536, "vocab_size 70000 at offset 12 does not fit the model's vocabulary of 65536")
    run(conv + ["info", out], must_say="version 2, vocabulary 70000, 32-bit")
    if example:  # the example's --data path: the same reader, the model's vocabulary checked against the header
        train = [example, "--ranks", "2", "--steps", "2", "--microbatches", "2", "--micro-batch-size", "1",
                 "--seq-len", "16", "--pack", "--data", out]
        run(train + ["--vocab", "70000"], must_say="done: 2 steps")
        run(train + ["--vocab", "65536"], expect_ok=False, must_say=[out, "vocab_size 70000"])

    # Ids of a Llama 3-sized vocabulary from a .npy.
    npy = npy_writer()
    ids = [(i * 40009) % 128256 for i in range(3000)] + [65535, 65536, 128255, 0]
    src, out = os.path.join(work, "ids.npy"), os.path.join(work, "ids.tok")
    npy(src, ids, "<i8")
    run(conv + ["npy", src, out, "--vocab", "128256"])
    assert header(out) == (2, 128256, 32, len(ids)), header(out)
    assert reader.tokens(out, 128256) == ids
    run(conv + ["npy", src, out], must_say="vocabulary 128256")  # the largest id + 1
    assert reader.tokens(out, 128256) == ids
    run(conv + ["npy", src, out, "--vocab", "128256", "--bits", "16"], False, "needs 32-bit tokens")
    small = [i % 300 for i in ids]
    npy(src, small, "<i8")
    run(conv + ["npy", src, out, "--vocab", "300", "--bits", "32"], must_say="32-bit")
    assert header(out) == (2, 300, 32, len(small)), header(out)
    assert reader.tokens(out, 300) == small

    # Bad 32-bit files: one error from the reader, naming the file and what was expected.
    npy(src, ids, "<i8")
    good = os.path.join(work, "good.tok")
    run(conv + ["npy", src, good, "--vocab", "128256"])
    data = open(good, "rb").read()
    for name, content, needles in [
            ("width24.tok", data[:24] + struct.pack("<I", 24) + data[28:], ["token width 24 bits at offset 24",
                                                                            "expected 16 or 32"]),
            ("truncated.tok", data[:-2], ["truncated at offset", f"{len(data) - 2}"]),
            ("beyond.tok", data[:32] + struct.pack("<I", 128256) + data[36:],
             ["token 128256 at offset 32 is >= the vocabulary size 128256"])]:
        path = os.path.join(work, name)
        with open(path, "wb") as f:
            f.write(content)
        reader.refuses(path, 128256, *needles)
    print(f"tokens.py wide: 16-bit and 32-bit files (text, .npy ids up to {max(ids)}, --bits 32) read back by the "
          "C++ reader; a smaller model, a 24-bit width, truncated data and a token beyond the vocabulary refused"
          + ("; llama_pipeline trained on a 32-bit file" if example else ""))


def train_tokenizer(path):
    """A byte-level BPE tokenizer trained on TEXT (vocabulary > 256), saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, min_frequency=1, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXT.splitlines(keepends=True), trainer)
    tokenizer.save(path)
    return tokenizer


def check_tokenizer(reader, work):
    try:
        import tokenizers
    except ImportError:
        print(f"SKIP: the Python package 'tokenizers' is not installed in {sys.executable} "
              "(pip install tokenizers; scripts/setup.sh installs it)")
        return SKIP
    conv = [sys.executable, TOKENS]
    tok_file, text = os.path.join(work, "tokenizer.json"), os.path.join(work, "corpus.txt")
    tokenizer = train_tokenizer(tok_file)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    assert 256 < vocab <= 65536, f"trained a vocabulary of {vocab}"
    with open(text, "w", encoding="utf-8") as f:
        f.write(TEXT)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert max(ids) > 255 and len(ids) < len(TEXT.encode()), "the tokenizer merged nothing"
    assert tokenizer.decode(ids) == TEXT
    # The brief's spelling (default command) and the explicit one; the tokenizer's vocabulary in 16 bits.
    out = os.path.join(work, "bpe.tok")
    run(conv + ["--tokenizer", tok_file, text, out], must_say=f"vocabulary {vocab}, 16-bit")
    assert header(out) == (1, vocab, 16, len(ids)), header(out)
    assert reader.tokens(out, vocab) == ids
    run(conv + ["text", "--tokenizer", tok_file, text, out])
    assert reader.tokens(out, vocab) == ids
    # 32 bits: a declared vocabulary beyond 16 bits, or asked for.
    out32 = os.path.join(work, "bpe32.tok")
    run(conv + ["--tokenizer", tok_file, "--vocab", "70000", text, out32], must_say="32-bit")
    assert header(out32) == (2, 70000, 32, len(ids)), header(out32)
    assert reader.tokens(out32, 70000) == ids
    run(conv + ["--tokenizer", tok_file, "--bits", "32", text, out32])
    assert header(out32) == (2, vocab, 32, len(ids)), header(out32)
    assert reader.tokens(out32, vocab) == ids
    reader.refuses(out32, vocab - 1, f"vocab_size {vocab} at offset 12", f"vocabulary of {vocab - 1}")
    # Refused by the script: a vocabulary below the tokenizer's, a tokenizer that is not one, text that is not UTF-8.
    run(conv + ["--tokenizer", tok_file, "--vocab", "256", text, out], False, f"vocabulary of {vocab}")
    run(conv + ["--tokenizer", text, text, out], False, "cannot load the tokenizer")
    binary = os.path.join(work, "binary.txt")
    with open(binary, "wb") as f:
        f.write(b"ok\xff\xfe")
    run(conv + ["--tokenizer", tok_file, binary, out], False, "not UTF-8 text (byte offset 2)")
    print(f"tokens.py --tokenizer: a BPE vocabulary of {vocab} trained with tokenizers {tokenizers.__version__}; "
          f"{len(ids)} ids read back by the C++ reader in 16 and 32 bits; 4 bad inputs refused")
    return 0


def main():
    mode, probe, work = sys.argv[1], sys.argv[2], sys.argv[3]
    example = sys.argv[4] if len(sys.argv) > 4 else None
    os.makedirs(work, exist_ok=True)
    reader = Reader(probe)
    if mode == "wide":
        check_wide(reader, work, example)
        return 0
    if mode == "tokenizer":
        return check_tokenizer(reader, work)
    sys.exit(f"unknown mode {mode!r} (wide or tokenizer)")


if __name__ == "__main__":
    sys.exit(main())
