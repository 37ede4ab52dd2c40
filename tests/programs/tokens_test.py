#!/usr/bin/env python3
"""scripts/tokens.py against the reader it writes for: llama_pipeline --data (twobp::data::read_token_file).

Usage: tokens_test.py LLAMA_PIPELINE WORK_DIR

Text and a hand-written .npy (versions 1 and 2, little- and big-endian, 2-D) become .tok files the example trains on;
ids outside the vocabulary, a float array and a truncated array are refused with an error naming the problem; the
tokens written equal the input's.
"""
import array
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = os.path.join(HERE, "..", "..", "scripts", "tokens.py")


def npy(path, values, descr="<i8", shape=None, version=1):
    """A .npy file written by hand (the format numpy.save writes), so the test needs no NumPy."""
    shape = shape or (len(values),)
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}".encode("latin1")
    prefix = 10 if version == 1 else 12
    header += b" " * ((64 - (prefix + len(header) + 1) % 64) % 64) + b"\n"
    size = struct.pack("<H", len(header)) if version == 1 else struct.pack("<I", len(header))
    body = array.array({"i8": "q", "u2": "H", "f4": "f", "i4": "i"}[descr[1:]], values)
    if descr[0] == ">":
        body.byteswap()
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY" + bytes([version, 0]) + size + header + body.tobytes())


def run(args, expect_ok=True, must_say=None):
    p = subprocess.run(args, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    if expect_ok and p.returncode != 0:
        sys.exit(f"FAILED (status {p.returncode}): {' '.join(args)}\n{out}")
    if not expect_ok and p.returncode == 0:
        sys.exit(f"FAILED: accepted {' '.join(args)}\n{out}")
    if must_say and must_say not in out:
        sys.exit(f"FAILED: {' '.join(args)} does not say {must_say!r}:\n{out}")
    return out


def tokens_of(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"TWOBPTOK", path
    _, _, vocab, n = struct.unpack("<8sIIQ", data[:24])
    return vocab, list(array.array("H", data[24:24 + 2 * n]))


def main():
    example, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    conv = [sys.executable, TOKENS]
    train = [example, "--ranks", "2", "--steps", "2", "--microbatches", "2", "--micro-batch-size", "1",
             "--seq-len", "16"]

    text = os.path.join(work, "corpus.txt")
    with open(text, "w") as f:
        f.write("A corpus of our own, long enough for a few sequences of sixteen tokens. " * 20)
    run(conv + ["text", text, os.path.join(work, "text.tok")])
    vocab, toks = tokens_of(os.path.join(work, "text.tok"))
    assert vocab == 256 and bytes(toks) == open(text, "rb").read(), "text tokens differ from the bytes"
    run(train + ["--data", os.path.join(work, "text.tok")], must_say="done: 2 steps")

    ids = [(i * 37) % 300 for i in range(2000)]
    for version, descr, shape in [(1, "<i8", None), (2, ">i8", None), (1, "<u2", (40, 50))]:
        src = os.path.join(work, f"ids{version}{descr[0] == '>'}.npy")
        npy(src, ids, descr, shape, version)
        out = os.path.join(work, "ids.tok")
        run(conv + ["npy", src, out, "--vocab", "300"])
        assert tokens_of(out) == (300, ids), f"{src}: tokens differ"
    run(train + ["--data", out, "--vocab", "300"], must_say="done: 2 steps")
    run(train + ["--data", out, "--vocab", "299"], expect_ok=False, must_say="299")  # the reader checks too

    bad = os.path.join(work, "bad.npy")
    npy(bad, ids, "<i8")
    run(conv + ["npy", bad, os.path.join(work, "x.tok"), "--vocab", "100"], False, "outside [0, 100)")
    npy(bad, [0.5, 1.5], "<f4")
    run(conv + ["npy", bad, os.path.join(work, "x.tok")], False, "not an integer type")
    npy(bad, [-1, 2], "<i4")
    run(conv + ["npy", bad, os.path.join(work, "x.tok")], False, "token 0 is -1")
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) - 2)
    run(conv + ["npy", bad, os.path.join(work, "x.tok")], False, "bytes of data")
    run(conv + ["npy", os.path.join(work, "missing.npy"), os.path.join(work, "x.tok")], False, "cannot read")
    run(conv + ["text", text, "/proc/twobp-nonexistent/x.tok"], False, "cannot write")
    assert not os.path.exists(os.path.join(work, "x.tok")), "a refused conversion left a file"
    print("tokens.py: text and .npy (v1, v2, big-endian, 2-D) convert and train; 6 bad inputs refused")


if __name__ == "__main__":
    main()
