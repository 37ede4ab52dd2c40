#!/usr/bin/env python3
"""twobp's Llama against transformers' LlamaForCausalLM, in float64.

For each case a small random LlamaForCausalLM (hidden 64, 4 layers, 4 heads, vocab 128) is built with transformers
in float64 and saved (safetensors); hf_probe (tests/models/hf_probe.cpp) imports it into 1, 2 and 4 twobp chunks
and writes what they compute. Checked:
  - the rotary inverse frequencies: bitwise transformers' (llama3 and linear scaling included);
  - logits, the loss and the gradient of every parameter: relative error <= 1e-12 (max |a - b| / max |b|);
  - the pipeline (hf_probe pipeline: models::build_llama_rank over rank threads, float64): the loss and every
    gradient at 1, 2 and 4 stages and with dp 2, 2BP and standard, the same tolerance;
  - tied embeddings: one chunk, and a pipeline whose first and last stages hold copies of the table (summed
    gradients, PipelineOptions::tied_parameters);
  - training: a few clipped AdamW steps of a pipeline (dp 2, tied embeddings), exported float32, load in
    transformers, whose float32 logits match twobp's float64 logits of the trained weights to 1e-5;
  - export: twobp's weights (float32 chunks, gathered from 2 chunks) written with export_hf_llama load in
    transformers (one file and shards + index), whose float32 logits match the float64 reference to 1e-5; a
    float64 export reproduces transformers' own model.safetensors byte for byte.
transformers' LlamaRMSNorm computes in float32 whatever its input (a guard for half types); the comparison patches
it to compute in its input's dtype, so that float64 means float64 on both sides. Attention runs through SDPA
(transformers' eager attention takes its softmax in float32 too).

usage: hf_compare.py --probe HF_PROBE --work DIR
exit status: 0 all checks passed, 1 a check failed, 77 skipped (torch, transformers or safetensors not importable
in this Python: scripts/setup.sh installs them).
"""

import argparse
import os
import shutil
import subprocess
import sys

SKIP = 77
TOLERANCE = 1e-12
EXPORT_TOLERANCE = 1e-5
failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def rel_error(got, want):
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def float64_rms_norm(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def build(directory, kv_heads, rope_scaling=None, tie=False, max_shard_size=None, seed=0):
    """A random float64 LlamaForCausalLM saved in `directory`; norms random too, so that a swapped norm shows."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=kv_heads,
        intermediate_size=96, vocab_size=128, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=rope_scaling, tie_word_embeddings=tie, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def reference(model, ids, targets):
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    return logits.detach(), loss.detach()


def run_probe(probe, *args):
    done = subprocess.run([probe, *map(str, args)], capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def compare_chunks(probe, work, name, model, ids, targets, chunks):
    batch = os.path.join(work, "batch.safetensors")
    safetensors.torch.save_file({"input_ids": ids, "targets": targets}, batch)
    want_logits, want_loss = reference(model, ids, targets)
    inv_freq = model.model.rotary_emb.inv_freq
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n in chunks:
        out = os.path.join(work, f"{name}-{n}.safetensors")
        rc, text = run_probe(probe, "forward", os.path.join(work, name), n, batch, out)
        if rc != 0:
            check(False, f"{name}, {n} chunk(s): hf_probe failed ({rc}): {text.strip()}")
            continue
        got = safetensors.torch.load_file(out)
        check(torch.equal(got["inv_freq"], inv_freq), f"{name}, {n} chunk(s): rotary inverse frequencies bitwise")
        e = rel_error(got["logits"], want_logits)
        check(e <= TOLERANCE, f"{name}, {n} chunk(s): logits, relative error {e:.2e}")
        e = rel_error(got["loss"], want_loss)
        check(e <= TOLERANCE, f"{name}, {n} chunk(s): loss {got['loss'].item():.15f}, relative error {e:.2e}")
        names = {k[len("grad."):] for k in got if k.startswith("grad.")}
        check(names == set(grads), f"{name}, {n} chunk(s): a gradient for each of the {len(grads)} parameters"
              + ("" if names == set(grads) else f" (differ: {sorted(names ^ set(grads))[:4]})"))
        worst = max((rel_error(got["grad." + k], g), k) for k, g in grads.items() if k in names)
        check(worst[0] <= TOLERANCE, f"{name}, {n} chunk(s): gradients, worst relative error {worst[0]:.2e} "
              f"({worst[1]})")
    return want_logits


def compare_pipeline(probe, work, name, model, ids, targets, layouts):
    """hf_probe pipeline at each (ranks, dp, schedule, mode) of `layouts`: its loss and gradients against the
    reference's over the same batch (a tied head's gradient is the embedding's, as transformers has it)."""
    batch = os.path.join(work, "pipeline-batch.safetensors")
    safetensors.torch.save_file({"input_ids": ids, "targets": targets}, batch)
    _, want_loss = reference(model, ids, targets)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for ranks, dp, schedule, mode in layouts:
        what = f"{name}, pipeline {schedule} {mode} {ranks} rank(s) x dp {dp}"
        out = os.path.join(work, f"{name}-pipeline-{ranks}-{dp}-{schedule}-{mode}.safetensors")
        rc, text = run_probe(probe, "pipeline", os.path.join(work, name), ranks, dp, schedule, mode, batch, out)
        if rc != 0:
            check(False, f"{what}: hf_probe failed ({rc}): {text.strip()}")
            continue
        got = safetensors.torch.load_file(out)
        e = rel_error(got["loss"], want_loss)
        check(e <= TOLERANCE, f"{what}: loss, relative error {e:.2e}")
        names = {k[len("grad."):] for k in got if k.startswith("grad.")}
        check(names == set(grads), f"{what}: a gradient for each of the {len(grads)} parameters"
              + ("" if names == set(grads) else f" (differ: {sorted(names ^ set(grads))[:4]})"))
        if names & set(grads):
            worst = max((rel_error(got["grad." + k], g), k) for k, g in grads.items() if k in names)
            check(worst[0] <= TOLERANCE, f"{what}: gradients, worst relative error {worst[0]:.2e} ({worst[1]})")


def compare_training(probe, work, name, ids, targets, ranks, dp, steps=3):
    """A pipeline trains `steps` steps from the checkpoint and exports; transformers loads the export and computes
    twobp's logits of the trained weights."""
    batch = os.path.join(work, "pipeline-batch.safetensors")
    safetensors.torch.save_file({"input_ids": ids, "targets": targets}, batch)
    out = os.path.join(work, f"{name}-trained.safetensors")
    export = os.path.join(work, f"{name}-trained")
    rc, text = run_probe(probe, "pipeline", os.path.join(work, name), ranks, dp, "1f1b", "2bp", batch, out, steps,
                         export)
    if rc != 0:
        check(False, f"{name}: training {steps} steps failed ({rc}): {text.strip()}")
        return
    got = safetensors.torch.load_file(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="sdpa")
    start = transformers.LlamaForCausalLM.from_pretrained(os.path.join(work, name), dtype=torch.float64,
                                                          attn_implementation="sdpa")
    with torch.no_grad():
        logits = loaded(input_ids=ids, use_cache=False).logits
        before = start(input_ids=ids, use_cache=False).logits
    trained = got["trained_logits"]
    check(rel_error(before, trained) > 1e-3, f"{name}: {steps} steps changed the model (logits moved "
          f"{rel_error(before, trained):.2e})")
    e = rel_error(logits.double(), trained)
    check(e <= EXPORT_TOLERANCE, f"{name}: trained {steps} steps at {ranks} rank(s) x dp {dp}, exported: "
          f"transformers' float32 logits against twobp's, relative error {e:.2e}")


def compare_export(probe, work, name, ids, want_logits, chunks, dtype="f32", max_shard_bytes=0):
    out_dir = os.path.join(work, f"{name}-export-{dtype}-{max_shard_bytes}")
    rc, text = run_probe(probe, "export", os.path.join(work, name), chunks, out_dir, dtype, max_shard_bytes)
    if rc != 0:
        check(False, f"{name}: export failed ({rc}): {text.strip()}")
        return None
    sharded = os.path.exists(os.path.join(out_dir, "model.safetensors.index.json"))
    check(sharded == (max_shard_bytes > 0), f"{name}: export {'sharded with an index' if sharded else 'one file'}")
    loaded = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        logits = loaded(input_ids=ids, use_cache=False).logits
    e = rel_error(logits.double(), want_logits)
    check(e <= EXPORT_TOLERANCE, f"{name}: transformers loads the {dtype} export from {chunks} chunks, float32 "
          f"logits relative error {e:.2e}")
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    global torch, transformers, safetensors
    try:
        import torch
        import transformers
        import safetensors.torch
    except ImportError as e:
        print(f"SKIP: the transformers comparison needs torch, transformers and safetensors in {sys.executable} "
              f"({e}); scripts/setup.sh installs them")
        return SKIP
    transformers.logging.set_verbosity_error()
    transformers.models.llama.modeling_llama.LlamaRMSNorm.forward = float64_rms_norm
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, safetensors "
          f"{safetensors.__version__}")
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 24))
    targets = torch.randint(0, 128, (2, 24))

    # GQA with Llama 3.1's rope scaling: wavelengths 2π·10⁴^(i/8) put frequencies 0-3 above, 4-5 in, 6-7 below
    # the interpolated band [2048/8, 2048/1].
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
              "original_max_position_embeddings": 2048}
    model = build(os.path.join(args.work, "gqa-llama3"), kv_heads=2, rope_scaling=llama3)
    want = compare_chunks(args.probe, args.work, "gqa-llama3", model, ids, targets, [1, 2, 4])
    compare_export(args.probe, args.work, "gqa-llama3", ids, want, chunks=2)
    compare_export(args.probe, args.work, "gqa-llama3", ids, want, chunks=4, max_shard_bytes=100_000)
    exported = compare_export(args.probe, args.work, "gqa-llama3", ids, want, chunks=1, dtype="f64")
    if exported:
        same = [open(os.path.join(d, "model.safetensors"), "rb").read()
                for d in (exported, os.path.join(args.work, "gqa-llama3"))]
        check(same[0] == same[1], "gqa-llama3: the float64 export is transformers' model.safetensors byte for byte")

    # Multi-head attention, saved by transformers in shards with an index.
    model = build(os.path.join(args.work, "mha-sharded"), kv_heads=4, max_shard_size="300KB", seed=2)
    check(os.path.exists(os.path.join(args.work, "mha-sharded", "model.safetensors.index.json")),
          "mha-sharded: transformers wrote shards and an index")
    compare_chunks(args.probe, args.work, "mha-sharded", model, ids, targets, [1, 2, 4])

    # Pipelines of rank threads, 4 sequences: 1, 2 and 4 stages, dp 2, 2BP and standard.
    torch.manual_seed(4)
    rows = torch.randint(0, 128, (4, 16))
    next_rows = torch.randint(0, 128, (4, 16))
    layouts = [(1, 1, "1f1b", "2bp"), (2, 1, "1f1b", "2bp"), (4, 1, "1f1b", "standard"), (2, 2, "zb-h1", "2bp"),
               (2, 1, "zb-v", "standard")]
    compare_pipeline(args.probe, args.work, "mha-sharded", model, rows, next_rows, layouts)

    # Tied embeddings (and linear rope scaling): one chunk only.
    model = build(os.path.join(args.work, "tied-linear"), kv_heads=2, tie=True, seed=3,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    want = compare_chunks(args.probe, args.work, "tied-linear", model, ids, targets, [1])
    compare_export(args.probe, args.work, "tied-linear", ids, want, chunks=1)
    # ... and split over stages: the head a copy of the embedding on the last stage, their gradients summed.
    compare_pipeline(args.probe, args.work, "tied-linear", model, rows, next_rows,
                     [(2, 1, "1f1b", "2bp"), (4, 1, "1f1b", "standard"), (2, 2, "1f1b", "2bp"),
                      (2, 1, "zb-v", "2bp")])
    compare_training(args.probe, args.work, "tied-linear", rows, next_rows, ranks=2, dp=2)
    model = build(os.path.join(args.work, "gqa-llama3-train"), kv_heads=2, rope_scaling=llama3, seed=5)
    compare_pipeline(args.probe, args.work, "gqa-llama3-train", model, rows, next_rows, [(4, 1, "1f1b", "2bp")])
    compare_training(args.probe, args.work, "gqa-llama3-train", rows, next_rows, ranks=4, dp=1)

    print(f"hf_compare: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
