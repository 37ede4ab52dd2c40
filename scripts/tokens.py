#!/usr/bin/env python3
"""Token files for llama_pipeline --data: converts text or a NumPy .npy array into twobp's .tok format.

  scripts/tokens.py text corpus.txt corpus.tok            # byte-level tokens (vocabulary 256), as the built-in corpus
  scripts/tokens.py npy ids.npy corpus.tok [--vocab N]     # token ids from any tokenizer, saved with numpy.save
  scripts/tokens.py info corpus.tok                        # header, token count, largest id

The format is specified in include/twobp/data.h (header "TWOBPTOK", version 1, vocab_size, num_tokens, then
uint16 little-endian tokens) and read by twobp::data::read_token_file, which checks it again; this script needs
only the Python standard library (no NumPy). Ids must be integers in [0, vocab) with vocab <= 65536.
"""
import argparse
import array
import ast
import os
import struct
import sys

MAGIC = b"TWOBPTOK"
VERSION = 1
MAX_VOCAB = 65536  # tokens are uint16
HEADER = struct.Struct("<8sIIQ")  # magic, version, vocab_size, num_tokens: 24 bytes

# .npy dtype (without byte order) -> array typecode of that size
NPY_INTEGERS = {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "u8": "Q", "i8": "q"}


def fail(message):
    sys.exit(f"tokens.py: error: {message}")


def write_tok(path, tokens, vocab):
    """Writes the header and the tokens via a temporary file and a rename (as write_token_file does)."""
    if not 1 <= vocab <= MAX_VOCAB:
        fail(f"--vocab {vocab}: must be in [1, {MAX_VOCAB}] (tokens are 16-bit)")
    if len(tokens) and not (0 <= min(tokens) and max(tokens) < vocab):
        i, t = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab)
        fail(f"token {i} is {t}, outside [0, {vocab}): give the tokenizer's vocabulary with --vocab")
    out = array.array("H", iter(tokens))
    if sys.byteorder != "little":
        out.byteswap()
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, vocab, len(out)))
            out.tofile(f)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        fail(f"cannot write {path}: {e.strerror}")
    print(f"{path}: {len(out)} tokens, vocabulary {vocab}")


def read_npy(path):
    """The integers of a .npy file (format versions 1-3), flattened in C order."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if data[:6] != b"\x93NUMPY" or len(data) < 10:
        fail(f"{path} is not a .npy file (no \\x93NUMPY magic)")
    major = data[6]
    if major == 1:
        header_len, start = struct.unpack("<H", data[8:10])[0], 10
    elif major in (2, 3):
        header_len, start = struct.unpack("<I", data[8:12])[0], 12
    else:
        fail(f"{path}: .npy format version {major} is not supported (1-3 are)")
    try:
        header = ast.literal_eval(data[start:start + header_len].decode("latin1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError):
        fail(f"{path}: unreadable .npy header")
    if not isinstance(descr, str) or descr[1:] not in NPY_INTEGERS:
        fail(f"{path}: dtype {descr!r} is not an integer type (save the token ids as an integer array)")
    if fortran and len(shape) > 1:
        fail(f"{path}: a Fortran-ordered array; save numpy.ascontiguousarray(ids) instead")
    count = 1
    for n in shape:
        count *= n
    values = array.array(NPY_INTEGERS[descr[1:]])
    body = data[start + header_len:]
    if len(body) != count * values.itemsize:
        fail(f"{path}: {len(body)} bytes of data for shape {shape} of {descr} ({count * values.itemsize} expected)")
    values.frombytes(body)
    if (descr[0] == ">" and sys.byteorder == "little") or (descr[0] == "<" and sys.byteorder == "big"):
        values.byteswap()
    return values


def info(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if data[:8] != MAGIC:
        print(f"{path}: no header (read as bare uint16 tokens), {len(data) // 2} tokens")
        return
    _, version, vocab, n = HEADER.unpack(data[:HEADER.size])
    tokens = array.array("H", data[HEADER.size:HEADER.size + 2 * n])
    print(f"{path}: version {version}, vocabulary {vocab}, {n} tokens, largest id {max(tokens, default=0)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    text = sub.add_parser("text", help="byte-level tokens of a text file (vocabulary 256)")
    text.add_argument("input")
    text.add_argument("output")
    npy = sub.add_parser("npy", help="token ids saved with numpy.save (any integer dtype and shape, C order)")
    npy.add_argument("input")
    npy.add_argument("output")
    npy.add_argument("--vocab", type=int, help="the tokenizer's vocabulary (default: the largest id + 1)")
    show = sub.add_parser("info", help="print a token file's header")
    show.add_argument("input")
    a = parser.parse_args()
    if a.command == "text":
        try:
            with open(a.input, "rb") as f:
                tokens = f.read()
        except OSError as e:
            fail(f"cannot read {a.input}: {e.strerror}")
        write_tok(a.output, tokens, 256)
    elif a.command == "npy":
        ids = read_npy(a.input)
        if len(ids) == 0:
            fail(f"{a.input} holds no tokens")
        write_tok(a.output, ids, a.vocab if a.vocab is not None else max(ids) + 1)
    else:
        info(a.input)


if __name__ == "__main__":
    main()
