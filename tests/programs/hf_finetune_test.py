#!/usr/bin/env python3
"""llama_pipeline with Hugging Face Llama directories: --init-from, --export-hf, --steps 0 (export only).

A tiny random Llama (hidden 64, 4 layers, 4 heads, 2 key/value heads, vocabulary 300, so that the built-in
byte-level corpus fits) is made with transformers when this Python has it, else by the example itself (--export-hf
of a fresh tiny twobp run). Checked:
  - fine-tuning from it at 2 ranks with 2BP, 2 steps, a checkpoint and --export-hf: a "written to" line, the
    directory's config.json and model.safetensors;
  - the export re-imports: --init-from it with --steps 0 --export-hf writes the same bytes (model.safetensors and
    config.json); so does --resume of the run's checkpoint with --steps 0 (its config.json travels in the
    checkpoint; a --resume that trains on continues with the losses of a run without a break), and, with
    --mpiexec, the same fine-tuning as 2 MPI processes (gathered over the MPI transport);
  - the first step's loss from --init-from is the same (relative 1e-6, float32) at 2 ranks, 4 ranks, dp 2 and an
    interleaved schedule with 2 chunks per rank;
  - --dtype bf16 exports its float32 masters (F32), --export-dtype bf16 writes BF16, which --init-from loads into
    float32 masters;
  - with transformers (and --probe): transformers loads the export, and its float32 logits equal twobp's
    (tests/models/hf_probe forward: the export imported into 2 chunks) to 1e-5 relative; tied embeddings: a tied
    Llama fine-tuned at 2 ranks exports what 1 rank does (1e-6), without lm_head.weight, and loads likewise;
  - refusals, each one line naming the option, no "written": --init-from with --resume, a missing directory, one
    without config.json, a contradicting --dim, --model, a token file whose vocabulary exceeds the model's, --steps 0
    without --export-hf.

usage: hf_finetune_test.py EXAMPLE WORK [--probe HF_PROBE] [--mpiexec MPIEXEC]
"""
import argparse
import json
import os
import shutil
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from program_runs import MPI_FLAGS, run  # noqa: E402

SIZES = ["--dim", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "96", "--vocab", "300"]
TRAIN = ["--seq-len", "32", "--microbatches", "4", "--micro-batch-size", "2"]
failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def same_export(a, b, what):
    for name in ("model.safetensors", "config.json"):
        check(read(os.path.join(a, name)) == read(os.path.join(b, name)), f"{what}: {name} byte for byte")


def first_loss(path):
    with open(path) as f:
        return json.load(f)["steps"][0]["loss"]


def dtypes(directory):
    """The dtypes of the tensors in DIR/model.safetensors (its header: a little-endian uint64 length, then JSON)."""
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def make_source(example, work, transformers, tie=False):
    """The model to start from: a random transformers Llama, or the example's export of a fresh tiny run."""
    source = os.path.join(work, "source_tied" if tie else "source")
    if transformers is None:
        run([example, *SIZES, *TRAIN, "--steps", "1", "--export-hf", source], must_say="written to " + source)
        print("source: the example's export of a fresh tiny run (transformers is not importable)")
        return source
    import torch
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie)
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    print(f"source: a random LlamaForCausalLM of transformers {transformers.__version__}"
          f"{', tied embeddings' if tie else ''}")
    return source


def check_tied(example, probe, work, transformers):
    """Tied embeddings (the table on the first and the last rank): fine-tuned at 2 ranks as at 1, exported without
    lm_head.weight, loaded by transformers with twobp's logits."""
    import safetensors.torch
    source = make_source(example, work, transformers, tie=True)
    tuned = {}
    for ranks in ("1", "2"):
        tuned[ranks] = os.path.join(work, f"tied_tuned{ranks}")
        run([example, "--init-from", source, "--ranks", ranks, *TRAIN, "--steps", "2", "--export-hf", tuned[ranks]],
            must_say="tied embeddings")
    a, b = (safetensors.torch.load_file(os.path.join(tuned[r], "model.safetensors")) for r in ("1", "2"))
    check("lm_head.weight" not in b and set(a) == set(b), "tied: the export has no lm_head.weight")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    check(worst <= 1e-6, f"tied: the 2-rank export equals the 1-rank one ({worst:.1e}, float32 rounding)")
    if probe:
        check_transformers(probe, work, tuned["2"], transformers, chunks="1")


def check_transformers(probe, work, tuned, transformers, chunks="2"):
    """transformers' float32 logits of the export against twobp's (hf_probe forward into `chunks` chunks)."""
    import safetensors.torch
    import torch
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (2, 16))
    batch = os.path.join(work, "batch.safetensors")
    safetensors.torch.save_file({"input_ids": ids, "targets": torch.roll(ids, -1, 1)}, batch)
    probed = os.path.join(work, "probe.safetensors")
    run([probe, "forward", tuned, chunks, batch, probed])
    want = safetensors.torch.load_file(probed)["logits"]
    model = transformers.LlamaForCausalLM.from_pretrained(tuned, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits.double()
    error = (got - want).abs().max().item() / want.abs().max().item()
    check(error <= 1e-5, f"transformers loads {os.path.basename(tuned)}; float32 logits vs twobp's, relative error "
          f"{error:.2e}")


def check_refusals(example, work, source):
    data = os.path.join(work, "vocab512.tok")  # byte tokens under a header declaring a vocabulary of 512
    text = os.path.join(work, "text.txt")
    with open(text, "w") as f:
        f.write("some text for the token file\n" * 200)
    run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "tokens.py"), "text", text,
         data, "--vocab", "512"])
    empty = os.path.join(work, "empty")
    os.makedirs(empty, exist_ok=True)
    cases = [
        (["--init-from", source, "--resume", "--checkpoint-dir", os.path.join(work, "ck")],
         "--init-from with --resume"),
        (["--init-from", os.path.join(work, "missing")], "--init-from"),
        (["--init-from", empty], "--init-from: cannot open"),
        (["--init-from", source, "--dim", "128"], "--dim 128 contradicts"),
        (["--init-from", source, "--model", "small"], "--model small"),
        (["--init-from", source, "--data", data, *TRAIN], "does not fit the model's vocabulary of 300"),
        (["--init-from", source, "--steps", "0"], "--steps 0"),
    ]
    for args, says in cases:
        out = run([example, *args], ok=False, must_say=says, timeout=60)
        check("written" not in out and "Traceback" not in out, f"refused: {' '.join(args)} ({says})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("example")
    parser.add_argument("work")
    parser.add_argument("--probe")
    parser.add_argument("--mpiexec")
    args = parser.parse_args()
    try:
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError as e:
        print(f"note: transformers is not importable in {sys.executable} ({e}): the transformers checks are skipped")
        transformers = None
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    w = lambda name: os.path.join(args.work, name)  # noqa: E731
    source = make_source(args.example, args.work, transformers)

    # Fine-tuning at 2 ranks with 2BP: 2 steps, a checkpoint, the export.
    out = run([args.example, "--init-from", source, "--ranks", "2", "--2bp", *TRAIN, "--steps", "2", "--json",
               w("run.json"), "--checkpoint-dir", w("ck"), "--export-hf", w("tuned")],
              must_say="written to " + w("tuned"))
    check(f"initialised from {source}" in out, "--init-from: the run says where its weights came from")
    with open(w("run.json")) as f:
        doc = json.load(f)
    check(doc["2bp"] and len(doc["steps"]) == 2, "2 steps with 2BP")
    check(all(os.path.exists(os.path.join(w("tuned"), n)) for n in ("config.json", "model.safetensors")),
          "--export-hf wrote config.json and model.safetensors")

    # The export re-imports (and exports the same bytes); the checkpoint exports the same model.
    run([args.example, "--init-from", w("tuned"), "--steps", "0", "--export-hf", w("again")],
        must_say="written to " + w("again"))
    same_export(w("tuned"), w("again"), "--init-from the export, --steps 0 --export-hf")
    run([args.example, "--resume", "--checkpoint-dir", w("ck"), "--steps", "0", "--export-hf", w("from_ck")],
        must_say="written to " + w("from_ck"))
    same_export(w("tuned"), w("from_ck"), "--resume of the run's checkpoint, --steps 0 --export-hf")
    # A run from --init-from resumes without it (its checkpoint holds the config.json) and continues identically.
    run([args.example, "--init-from", source, *TRAIN, "--steps", "3", "--json", w("full3.json")])
    run([args.example, "--init-from", source, *TRAIN, "--steps", "3", "--stop-after", "2", "--checkpoint-dir",
         w("ck3")])
    run([args.example, "--resume", "--checkpoint-dir", w("ck3"), *TRAIN, "--steps", "3", "--json", w("resumed.json")],
        must_say="resuming from step 2 of 3")
    with open(w("full3.json")) as f, open(w("resumed.json")) as g:
        full, resumed = json.load(f)["steps"][-1]["loss"], json.load(g)["steps"][-1]["loss"]
    check(full == resumed, f"--resume of a run from --init-from: step 3's loss {resumed!r} as without a break "
          f"({full!r})")
    if args.mpiexec:
        run([args.mpiexec, *MPI_FLAGS, "-n", "2", args.example, "--init-from", source, *TRAIN, "--steps", "2",
             "--export-hf", w("tuned_mpi")], must_say="written to " + w("tuned_mpi"))
        same_export(w("tuned"), w("tuned_mpi"), "2 MPI processes")

    # Any layout from --init-from: the first step's loss as at 2 ranks.
    want = first_loss(w("run.json"))
    layouts = [("4 ranks", ["--ranks", "4"]), ("dp 2", ["--dp", "2", "--microbatches", "2"]),
               ("interleaved, 2 chunks per rank", ["--schedule", "interleaved-1f1b", "--chunks-per-rank", "2"])]
    for k, (name, layout) in enumerate(layouts):
        json_path = w(f"layout{k}.json")
        run([args.example, "--init-from", source, *TRAIN, "--steps", "1", *layout, "--json", json_path])
        got = first_loss(json_path)
        check(abs(got - want) <= 1e-6 * abs(want), f"{name}: first loss {got!r} vs {want!r} at 2 ranks")

    # Precision: mixed bf16 trains float32 masters and exports them; --export-dtype bf16 writes bfloat16, which
    # loads into float32 masters again.
    run([args.example, "--init-from", source, *TRAIN, "--steps", "1", "--dtype", "bf16", "--export-hf",
         w("bf16_masters"), "--json", w("bf16.json")])
    check(dtypes(w("bf16_masters")) == {"F32"}, "--dtype bf16: the float32 masters exported as F32")
    got = first_loss(w("bf16.json"))  # bfloat16 compute from the loaded masters: near float32's first loss
    check(abs(got - want) <= 1e-3 * abs(want), f"--dtype bf16: first loss {got!r} near float32's {want!r} (1e-3)")
    run([args.example, "--init-from", w("tuned"), "--steps", "0", "--export-dtype", "bf16", "--export-hf",
         w("as_bf16")])
    check(dtypes(w("as_bf16")) == {"BF16"}, "--export-dtype bf16: BF16")
    run([args.example, "--init-from", w("as_bf16"), *TRAIN, "--steps", "1", "--dtype", "bf16", "--export-hf",
         w("from_bf16")], must_say="written to " + w("from_bf16"))
    check(dtypes(w("from_bf16")) == {"F32"}, "a BF16 directory into float32 masters (--dtype bf16), exported as F32")

    if transformers is not None and args.probe:
        check_transformers(args.probe, args.work, w("tuned"), transformers)
    if transformers is not None:
        check_tied(args.example, args.probe, args.work, transformers)
    if transformers is not None and not args.probe:
        print("note: no --probe (tests/models/hf_probe not built): transformers' logits not compared")
    check_refusals(args.example, args.work, source)
    print(f"hf_finetune: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
