#!/usr/bin/env python3
"""Token files for llama_pipeline --data: converts text or a NumPy .npy array into twobp's .tok format.

  scripts/tokens.py text corpus.txt corpus.tok            # byte-level tokens (vocabulary 256), as the built-in corpus
  scripts/tokens.py corpus.txt corpus.tok                 # the same: "text" is the default command
  scripts/tokens.py --tokenizer tokenizer.json corpus.txt corpus.tok   # a Hugging Face tokenizer's ids (its vocabulary)
  scripts/tokens.py npy ids.npy corpus.tok [--vocab N]     # token ids from any tokenizer, saved with numpy.save
  scripts/tokens.py info corpus.tok                        # header, token width, token count, largest id

The format is specified in include/twobp/data.h and read by twobp::data::read_token_file, which checks it again:
header "TWOBPTOK", then version 1 (vocab_size <= 65536, num_tokens, uint16 tokens) when 16 bits hold the vocabulary,
else version 2 (vocab_size, num_tokens, token_bits = 32, a reserved 0, uint32 tokens), all little-endian. --bits 32
asks for 32-bit tokens whatever the vocabulary. Ids must be integers in [0, vocab).

--tokenizer loads a tokenizer.json (Llama 3's, or any the Python package `tokenizers` reads; pip install tokenizers)
and encodes the whole text in one call, without the tokenizer's special tokens (no BOS/EOS is added); its vocabulary
(added tokens included) is the file's, unless --vocab gives a larger one. The rest needs only the standard library.
"""
import argparse
import array
import ast
import os
import struct
import sys

MAGIC = b"TWOBPTOK"
MAX_VOCAB = 2**32 - 1  # vocab_size is a uint32
HEADER_V1 = struct.Struct("<8sIIQ")    # magic, version 1, vocab_size, num_tokens: 24 bytes, uint16 tokens follow
HEADER_V2 = struct.Struct("<8sIIQII")  # ... token_bits, reserved: 32 bytes, tokens of token_bits follow
COMMANDS = ("text", "npy", "info")

# .npy dtype (without byte order) -> array typecode of that size
NPY_INTEGERS = {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "u8": "Q", "i8": "q"}


def fail(message):
    sys.exit(f"tokens.py: error: {message}")


def token_bits(vocab, bits=None):
    """The width write_tok uses: `bits` if given (16 only when the vocabulary fits), else the narrowest that holds
    the vocabulary -- the rule of twobp::data::token_bits_for."""
    if bits is None:
        return 16 if vocab <= 65536 else 32
    if bits == 16 and vocab > 65536:
        fail(f"--bits 16: a vocabulary of {vocab} needs 32-bit tokens (16 bits hold at most 65536)")
    return bits


def write_tok(path, tokens, vocab, bits=None):
    """Writes the header and the tokens via a temporary file and a rename (as write_token_file does): version 1 with
    16-bit tokens, version 2 with 32-bit ones."""
    if not 1 <= vocab <= MAX_VOCAB:
        fail(f"--vocab {vocab}: must be in [1, {MAX_VOCAB}]")
    bits = token_bits(vocab, bits)
    if len(tokens) and not (0 <= min(tokens) and max(tokens) < vocab):
        i, t = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab)
        fail(f"token {i} is {t}, outside [0, {vocab}): give the tokenizer's vocabulary with --vocab")
    out = array.array("H" if bits == 16 else "I", iter(tokens))
    assert out.itemsize == bits // 8, f"array typecode of {out.itemsize} bytes for {bits}-bit tokens"
    if sys.byteorder != "little":
        out.byteswap()
    header = (HEADER_V1.pack(MAGIC, 1, vocab, len(out)) if bits == 16
              else HEADER_V2.pack(MAGIC, 2, vocab, len(out), 32, 0))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            out.tofile(f)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        fail(f"cannot write {path}: {e.strerror}")
    print(f"{path}: {len(out)} tokens, vocabulary {vocab}, {bits}-bit")


def read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")


def tokenize(path, tokenizer_file):
    """The ids of `path`'s text under the tokenizer in `tokenizer_file`, and its vocabulary size."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("--tokenizer needs the Python package 'tokenizers' (pip install tokenizers), which this Python "
             f"({sys.executable}) does not have")
    try:
        tokenizer = Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # the package raises its own exception types (and OSError-like ones from Rust)
        fail(f"cannot load the tokenizer {tokenizer_file}: {e}")
    data = read_text(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"{path} is not UTF-8 text (byte offset {e.start}): a tokenizer encodes text")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    # Added tokens included; the largest id too, should the vocabulary have holes.
    vocab = max(tokenizer.get_vocab_size(with_added_tokens=True),
                max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
    return ids, vocab


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
    data = read_text(path)
    if data[:8] != MAGIC:
        print(f"{path}: no header (read as bare uint16 tokens), {len(data) // 2} tokens")
        return
    if len(data) < 12:
        fail(f"{path}: truncated header ({len(data)} bytes)")
    version = struct.unpack("<I", data[8:12])[0]
    header = {1: HEADER_V1, 2: HEADER_V2}.get(version)
    if header is None or len(data) < header.size:
        fail(f"{path}: unsupported version {version} or truncated header ({len(data)} bytes)")
    fields = header.unpack(data[:header.size])
    vocab, n, bits = fields[2], fields[3], fields[4] if version == 2 else 16
    if bits not in (16, 32):
        fail(f"{path}: token width {bits} bits at offset 24 (expected 16 or 32)")
    tokens = array.array("H" if bits == 16 else "I", data[header.size:header.size + bits // 8 * n])
    if sys.byteorder != "little":
        tokens.byteswap()
    print(f"{path}: version {version}, vocabulary {vocab}, {bits}-bit, {n} tokens, largest id {max(tokens, default=0)}")


def main(argv):
    # "text" is the default command: tokens.py [--tokenizer T] in.txt out.tok
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["text"] + argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    text = sub.add_parser("text", help="text to tokens: byte-level (vocabulary 256), or a tokenizer's with --tokenizer")
    text.add_argument("input")
    text.add_argument("output")
    text.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (needs the package 'tokenizers')")
    npy = sub.add_parser("npy", help="token ids saved with numpy.save (any integer dtype and shape, C order)")
    npy.add_argument("input")
    npy.add_argument("output")
    for command in (text, npy):
        command.add_argument("--vocab", type=int, help="the vocabulary written to the header (default: the "
                             "tokenizer's; 256 for bytes; for npy the largest id + 1)")
        command.add_argument("--bits", type=int, choices=(16, 32),
                             help="token width (default: 16 when the vocabulary fits, else 32)")
    show = sub.add_parser("info", help="print a token file's header")
    show.add_argument("input")
    a = parser.parse_args(argv)
    if a.command == "text":
        if a.tokenizer:
            tokens, vocab = tokenize(a.input, a.tokenizer)
        else:
            tokens, vocab = read_text(a.input), 256
        if a.vocab is not None and a.vocab < vocab:
            kind = "tokenizer" if a.tokenizer else "byte"
            fail(f"--vocab {a.vocab} is smaller than the {kind} vocabulary of {vocab}")
        write_tok(a.output, tokens, a.vocab if a.vocab is not None else vocab, a.bits)
    elif a.command == "npy":
        ids = read_npy(a.input)
        if len(ids) == 0:
            fail(f"{a.input} holds no tokens")
        write_tok(a.output, ids, a.vocab if a.vocab is not None else max(ids) + 1, a.bits)
    else:
        info(a.input)


if __name__ == "__main__":
    main(sys.argv[1:])
