#!/usr/bin/env python3
"""Peer benchmark: PyTorch's own ``torch.distributed.pipelining`` against twobp on the same LLaMa-like model.

One command runs both sides, one schedule after the other (never at the same time), in interleaved rounds: for each
schedule torch, twobp, torch, twobp, ... (--rounds, default 3), so that a noisy minute hits one round of both
sides, not one side; each side's number is the median over the rounds of its per-round median step time, with
the spread (lowest and highest round) beside it:

    python3 benchmarks/peer/torch_pipelining.py [--schedules gpipe,1f1b,...] [--rounds 3] [--json OUT]

Torch side: 2 ranks (``torch.multiprocessing``, spawn), gloo backend, CPU, float32, ``torch.set_num_threads(1)`` per
rank. A fresh pair of processes (and process group) per schedule, so a schedule that fails or hangs cannot take the
others down: its error is printed in its row and the run goes on.

twobp side: ``mpirun -np 2 ... build/benchmarks/twobp_bench pipeline --schedule NAME --mode both ... --threads 1``
(standard backprop and 2BP in one launch) with the same dimensions, micro-batch count and size, sequence length,
warm-up and measured steps.

Schedule mapping (torch class -> twobp schedule, stages per rank v, placement):

    gpipe             ScheduleGPipe                  -> gpipe             v=1
    1f1b              Schedule1F1B                   -> 1f1b              v=1
    interleaved-1f1b  ScheduleInterleaved1F1B        -> interleaved-1f1b  v=2, loop placement (stage s on rank s % p)
    interleaved-zb    ScheduleInterleavedZeroBubble  -> interleaved-zb    v=2, loop placement (twobp's 2BP form is
                      torch's order action for action; its standard form fuses each I and W into B)
    looped-bfs        ScheduleLoopedBFS              -> looped-bfs        v=2, loop placement
    zb-v              ScheduleZBVZeroBubble          -> zb-v              v=2, V placement (rank r: stages r, 2p-1-r)
    dualpipev         ScheduleDualPipeV              -> dualpipev         v=2, V placement (needs m >= 2p on torch;
                      twobp's 2BP form is torch's order with each OVERLAP_F_B run as its F then its B, as torch
                      does without an overlap callback)
    zb-h1 (ref)       (none)                         -> zb-h1             twobp-only single-chunk ZB-H1

Notes on what is and is not identical:
  * The model is a PyTorch transcription of twobp's models::LlamaChunk (include/twobp/models/llama.h,
    src/models/llama.cpp): token embedding on the first stage, pre-norm blocks (RMSNorm, rotary rotate-half with
    angles recomputed every call as twobp does, grouped-query causal SDPA, SwiGLU without biases), final RMSNorm + LM
    head on the last stage, mean cross entropy over the tokens of a micro-batch.
  * Blocks are split over the p*v stages with the same balanced-by-compute dynamic program as twobp's
    make_partition (ported below); the layout is printed.
  * Weights are drawn N(0, 0.02^2) (residual projections scaled by 1/sqrt(2 L), norms 1) like twobp, but not from
    twobp's per-name generators, so the values differ; the shapes and FLOPs are the same.
  * Timing as twobp_bench's pipeline command: zero_grad (grads set to None) outside the timed region, then
    barrier, t0, schedule.step(...), barrier, t1 on every rank; step time = median over the measured steps of rank
    0's t1 - t0; tokens/s = m * micro_batch_size * seq / step time. No optimizer step on either side.
  * Which twobp mode computes what torch's schedule computes is read from the actions torch runs ("torch form"):
    its zero-bubble schedules (interleaved-zb, zb-v, dualpipev) split backward into I and W, as twobp's 2BP mode
    does, the others run full backwards (B), as twobp's standard mode. "same form/torch" compares those two, and
    is the measure of per-action overhead; "std/torch" compares twobp's standard mode with torch's schedule
    whatever its form.
  * torch's schedules scale the gradients by 1/m (scale_grads=True, their default); twobp accumulates the per-micro-
    batch means. This costs one in-place scale per parameter per step, negligible here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# name -> (torch class name, stages per rank, placement style, twobp schedule for the comparison)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop", "gpipe"),
    "1f1b": ("Schedule1F1B", 1, "loop", "1f1b"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop", "interleaved-1f1b"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop", "interleaved-zb"),
    "looped-bfs": ("ScheduleLoopedBFS", 2, "loop", "looped-bfs"),
    "zb-v": ("ScheduleZBVZeroBubble", 2, "v", "zb-v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v", "dualpipev"),
}
DEFAULT_SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "looped-bfs", "zb-v", "dualpipev"]
REFERENCE_ONLY = {"zb-h1"}  # twobp-only reference rows (no torch counterpart)


# ---------------------------------------------------------------------------------------------------------------
# Partition: port of twobp::models::make_partition (balanced by compute)
# ---------------------------------------------------------------------------------------------------------------

def block_forward_flops(a) -> float:
    kv_dim = a.kv_heads * (a.dim // a.heads)
    gemm_params = a.dim * a.dim * 2 + a.dim * kv_dim * 2 + 3 * a.dim * a.ffn
    return 2.0 * a.seq * gemm_params + 2.0 * a.seq * a.seq * a.dim


def head_cost_in_blocks(a) -> float:
    return (2.0 * a.seq * a.dim * a.vocab) / block_forward_flops(a)


def balance(layers: int, chunks: int, head_cost: float) -> list[int]:
    """Exact min-max contiguous split; chunks 0..C-2 get >= 1 block, the last >= 0 and carries the head's cost."""
    if chunks > layers + 1:
        raise ValueError(f"cannot split {layers} blocks into {chunks} chunks")
    inf = math.inf
    best = [[inf] * (layers + 1) for _ in range(chunks)]
    best[0][0] = 0.0
    for c in range(1, chunks):
        for j in range(c, layers + 1):
            for i in range(c - 1, j):
                if best[c - 1][i] == inf:
                    continue
                best[c][j] = min(best[c][j], max(best[c - 1][i], float(j - i)))
    optimum, split = inf, -1
    for i in range(chunks - 1, layers + 1):
        v = max(best[chunks - 1][i], (layers - i) + head_cost)
        if v <= optimum + 1e-12:
            optimum = min(optimum, v)
            split = i
    counts = [0] * chunks
    counts[chunks - 1] = layers - split
    j = split
    for c in range(chunks - 1, 0, -1):
        chosen = -1
        for i in range(j - 1, c - 2, -1):
            if best[c - 1][i] <= optimum + 1e-12 and (j - i) <= optimum + 1e-12:
                chosen = i
                break
        counts[c - 1] = j - chosen
        j = chosen
    return counts


def stage_to_rank(num_stages: int, ranks: int, style: str) -> list[int]:
    if style == "v":
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages)]
    return [s % ranks for s in range(num_stages)]


# ---------------------------------------------------------------------------------------------------------------
# Model: PyTorch transcription of twobp's LlamaChunk
# ---------------------------------------------------------------------------------------------------------------

def build_model_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def apply_rotary(x, theta):
        seq, half = x.size(2), x.size(3) // 2
        inv_freq = torch.pow(theta, -torch.arange(0, half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    class Block(nn.Module):
        def __init__(self, a):
            super().__init__()
            self.dim, self.heads, self.kv_heads = a.dim, a.heads, a.kv_heads
            self.hd = a.dim // a.heads
            kv_dim = a.kv_heads * self.hd
            self.attn_norm = RMSNorm(a.dim)
            self.wq = nn.Linear(a.dim, a.dim, bias=False)
            self.wk = nn.Linear(a.dim, kv_dim, bias=False)
            self.wv = nn.Linear(a.dim, kv_dim, bias=False)
            self.wo = nn.Linear(a.dim, a.dim, bias=False)
            self.mlp_norm = RMSNorm(a.dim)
            self.w1 = nn.Linear(a.dim, a.ffn, bias=False)
            self.w3 = nn.Linear(a.dim, a.ffn, bias=False)
            self.w2 = nn.Linear(a.ffn, a.dim, bias=False)

        def forward(self, x):
            b, s, hd = x.size(0), x.size(1), self.hd
            h = self.attn_norm(x)
            q = self.wq(h).view(b, s, self.heads, hd).transpose(1, 2)
            k = self.wk(h).view(b, s, self.kv_heads, hd).transpose(1, 2)
            v = self.wv(h).view(b, s, self.kv_heads, hd).transpose(1, 2)
            q = apply_rotary(q, 10000.0)
            k = apply_rotary(k, 10000.0)
            rep = self.heads // self.kv_heads
            if rep > 1:
                k = k.repeat_interleave(rep, 1)
                v = v.repeat_interleave(rep, 1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = x + self.wo(att.transpose(1, 2).reshape(b, s, self.dim))
            m = self.mlp_norm(y)
            return y + self.w2(F.silu(self.w1(m)) * self.w3(m))

    class Chunk(nn.Module):
        def __init__(self, a, first_layer, end_layer, has_embedding, has_head, seed):
            super().__init__()
            self.embed = nn.Embedding(a.vocab, a.dim) if has_embedding else None
            self.layers = nn.ModuleDict({str(i): Block(a) for i in range(first_layer, end_layer)})
            self.norm = RMSNorm(a.dim) if has_head else None
            self.head = nn.Linear(a.dim, a.vocab, bias=False) if has_head else None
            gen = torch.Generator().manual_seed(seed * 1000 + first_layer)
            std_res = 0.02 / math.sqrt(2.0 * a.layers)
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if name.endswith("norm.weight"):
                        p.fill_(1.0)
                    else:
                        std = std_res if (name.endswith(".wo.weight") or name.endswith(".w2.weight")) else 0.02
                        p.normal_(0.0, std, generator=gen)

        def forward(self, x):
            h = self.embed(x) if self.embed is not None else x
            for blk in self.layers.values():
                h = blk(h)
            if self.head is not None:
                h = self.head(self.norm(h))
            return h

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    return Chunk, loss_fn


# ---------------------------------------------------------------------------------------------------------------
# Torch side: one rank
# ---------------------------------------------------------------------------------------------------------------

def torch_rank(rank, world, port, a, name, counts, result_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    out = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a.timeout))
        import torch.distributed.pipelining as pp

        if a.patch_self_p2p:
            # torch 2.11's PipelineStage._get_init_p2p_neighbors_ops posts a dummy send/recv to the ranks of the
            # neighbouring stages, also when that neighbour is on this very rank (ZB-V with 2 ranks: stages 1 and 2
            # both on rank 1). Gloo cannot send to its own rank ("Pair is not connected" / connection reset), so
            # stock ScheduleZBVZeroBubble fails on CPU. This drops only those self-addressed warm-up ops; the
            # schedule's own SEND/RECV actions already skip same-rank neighbours (_add_send_recv), so the step
            # itself is unchanged. --no-patch-self-p2p shows the stock failure.
            from torch.distributed.pipelining import stage as pp_stage

            original = pp_stage._PipelineStageBase._get_init_p2p_neighbors_ops

            def _init_ops_without_self(self):
                return [op for op in original(self) if op.group_peer != self.group_rank]

            pp_stage._PipelineStageBase._get_init_p2p_neighbors_ops = _init_ops_without_self

        cls_name, v, style, _ = SCHEDULES[name]
        num_stages = world * v
        placement = stage_to_rank(num_stages, world, style)
        Chunk, loss_fn = build_model_classes()
        starts = [sum(counts[:s]) for s in range(num_stages)]
        stages = []
        for s in range(num_stages):
            if placement[s] != rank:
                continue
            mod = Chunk(a, starts[s], starts[s] + counts[s], s == 0, s == num_stages - 1, seed=1)
            # Static shapes (micro-batch sized, meta tensors) instead of runtime shape inference: like twobp's
            # activation_spec, and it avoids torch's object-list shape exchange (which needs numpy).
            mb, hidden = a.micro_batch_size, (a.micro_batch_size, a.seq, a.dim)
            in_meta = (torch.empty((mb, a.seq), dtype=torch.long, device="meta") if s == 0
                       else torch.empty(hidden, device="meta"))
            out_meta = torch.empty((mb, a.seq, a.vocab) if s == num_stages - 1 else hidden, device="meta")
            stages.append(pp.PipelineStage(mod, s, num_stages, torch.device("cpu"), input_args=in_meta,
                                           output_args=out_meta))
        cls = getattr(pp, cls_name)
        if v == 1:
            schedule = cls(stages[0], n_microbatches=a.microbatches, loss_fn=loss_fn)
        else:
            schedule = cls(stages, n_microbatches=a.microbatches, loss_fn=loss_fn)

        gen = torch.Generator().manual_seed(7)
        batch = a.microbatches * a.micro_batch_size
        tokens = torch.randint(a.vocab, (batch, a.seq + 1), generator=gen, dtype=torch.long)
        inputs, targets = tokens[:, : a.seq].contiguous(), tokens[:, 1:].contiguous()
        my_stages = [s for s in range(num_stages) if placement[s] == rank]
        has_first, has_last = 0 in my_stages, (num_stages - 1) in my_stages

        times, cpu, losses_seen = [], [], []
        for step in range(a.warmup + a.steps):
            for st in stages:
                st.submod.zero_grad(set_to_none=True)
            losses = [] if has_last else None
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if has_first:
                schedule.step(inputs, target=targets if has_last else None, losses=losses, return_outputs=False)
            else:
                schedule.step(target=targets if has_last else None, losses=losses, return_outputs=False)
            dist.barrier()
            ms = (time.perf_counter() - t0) * 1000.0
            cpu_ms = (time.process_time() - c0) * 1000.0
            if step >= a.warmup:
                times.append(ms)
                cpu.append(cpu_ms)
                if losses:
                    losses_seen.append(float(torch.stack([l.detach() for l in losses]).mean()))
        out.update(ok=True, step_ms=times, cpu_ms=cpu, stages=my_stages,
                   mean_loss=losses_seen[-1] if losses_seen else None,
                   backward_actions=backward_actions(schedule, rank))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report anything, the parent decides
        out.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    with open(result_path, "w") as f:
        json.dump(out, f)


def backward_actions(schedule, rank) -> dict:
    """How many full backwards (B) and split ones (I, W) this rank's torch schedule runs, composite actions (DualPipeV's
    OVERLAP_F_B) counted by their parts. Read from what the schedule executes (the lowered order with communication
    where there is one, after torch merged adjacent I and W of one micro-batch into B), not from the class name."""
    order = getattr(schedule, "pipeline_order_with_comms", None) or getattr(schedule, "pipeline_order", None) or {}
    counts = {"B": 0, "I": 0, "W": 0}
    for action in order.get(rank) or []:
        for part in (getattr(action, "sub_actions", None) or [action]) if action is not None else []:
            kind = str(getattr(part.computation_type, "value", part.computation_type))
            if kind in counts:
                counts[kind] += 1
    return counts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(a, name, counts):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        procs = [ctx.Process(target=torch_rank, args=(r, 2, port, a, name, counts, paths[r])) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.time() + a.timeout + 60
        for p in procs:
            p.join(max(1.0, deadline - time.time()))
        timed_out = False
        for p in procs:
            if p.is_alive():
                timed_out = True
                p.kill()  # only the processes this function started
                p.join()
        results = []
        for r, path in enumerate(paths):
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                results.append({"rank": r, "ok": False,
                                "error": "timed out" if timed_out else f"exited with code {procs[r].exitcode}"})
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if not r.get("ok")]
    if errors:
        tb = next((r.get("traceback") for r in results if not r.get("ok") and r.get("traceback")), None)
        return {"ok": False, "error": "; ".join(errors), "traceback": tb}
    times = results[0]["step_ms"]
    med = statistics.median(times)
    tokens = a.microbatches * a.micro_batch_size * a.seq
    loss = next((r["mean_loss"] for r in results if r.get("mean_loss") is not None), None)
    actions = {k: sum(r["backward_actions"][k] for r in results) for k in ("B", "I", "W")}
    return {"ok": True, "step_ms_median": med, "step_ms": times, "tokens_per_s": tokens / (med / 1000.0),
            "last_loss": loss, "stages_per_rank": [r["stages"] for r in results],
            # torch's schedule splits backward (I and W, as twobp's 2BP mode) when it runs any W at all.
            "backward_actions": actions, "form": "2bp" if actions["W"] else "standard",
            # CPU time of each rank's process (all its threads) per measured step, median: how much of the step
            # the rank computed (or spun) rather than waited.
            "cpu_ms_median_per_rank": [statistics.median(r["cpu_ms"]) for r in results]}


# ---------------------------------------------------------------------------------------------------------------
# twobp side
# ---------------------------------------------------------------------------------------------------------------

def run_twobp(a, schedule):
    binary = os.path.join(REPO, a.twobp_bench)
    if not os.path.exists(binary):
        return {"ok": False, "error": f"{binary} missing (cmake --build build --target twobp_bench)"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "twobp.json")
        cmd = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader",
               "--mca", "btl_vader_single_copy_mechanism", "none", binary, "pipeline", "--schedule", schedule,
               "--mode", a.twobp_mode, "--microbatches", str(a.microbatches), "--dim", str(a.dim),
               "--layers", str(a.layers), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
               "--ffn", str(a.ffn), "--vocab", str(a.vocab), "--seq", str(a.seq),
               "--micro-batch-size", str(a.micro_batch_size), "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--threads", str(a.threads), "--json", out]
        print("  $ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.timeout + 120)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "timed out", "command": cmd}
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            return {"ok": False, "error": f"exit {proc.returncode}: " + " | ".join(tail), "command": cmd}
        with open(out) as f:
            data = json.load(f)
    res = {"ok": True, "command": cmd, "modes": {}}
    for r in data["results"]:
        row = {k: r.get(k) for k in ("tokens_per_s", "step_ms_median", "bubble_fraction", "sim_step_ms", "p", "m",
                                     "v")}
        if row["tokens_per_s"] is None and row["step_ms_median"]:  # same definition as twobp_bench's
            row["tokens_per_s"] = a.microbatches * a.micro_batch_size * a.seq / (row["step_ms_median"] / 1000.0)
        res["modes"][r["mode"]] = row
    return res


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------

def fmt(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def print_table(rows):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def over_rounds(values):
    """Median and spread of the per-round median step times (ms); None when no round succeeded."""
    values = [x for x in values if x is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "rounds": values}


def ms_cell(summary):
    """A step-time cell: median (lowest-highest round)."""
    if summary is None:
        return "-"
    return f"{fmt(summary['median'], 1)} ({fmt(summary['low'], 0)}-{fmt(summary['high'], 0)})"


def measure_schedule(a, n, layouts, tokens, errors):
    """Schedule n over a.rounds interleaved rounds (torch, twobp, ...): its table row and its JSON record; failed
    rounds are appended to errors."""
    if n in REFERENCE_ONLY:
        cls, v, twobp_name = "(none)", 1, n
    else:
        cls, v, _, twobp_name = SCHEDULES[n]
    torch_rounds, twobp_rounds = [], []
    for k in range(a.rounds):
        print(f"[{n}] round {k + 1}/{a.rounds} ...", file=sys.stderr, flush=True)
        if n in SCHEDULES and not a.no_torch:
            t_res = run_torch(a, n, layouts[v])
            torch_rounds.append(t_res)
            if not t_res["ok"]:
                errors.append((n, f"torch round {k + 1}", t_res["error"], t_res.get("traceback")))
        if not a.no_twobp:
            b_res = run_twobp(a, twobp_name)
            twobp_rounds.append(b_res)
            if not b_res["ok"]:
                errors.append((n, f"twobp round {k + 1}", b_res["error"], None))
    t_ok = [r for r in torch_rounds if r["ok"]]
    t_ms = over_rounds([r["step_ms_median"] for r in t_ok])
    mode_ms = {mode: over_rounds([r["modes"].get(mode, {}).get("step_ms_median") for r in twobp_rounds if r["ok"]])
               for mode in ("standard", "2bp")}
    t_tok = tokens / (t_ms["median"] / 1000.0) if t_ms else None
    std_tok = tokens / (mode_ms["standard"]["median"] / 1000.0) if mode_ms["standard"] else None
    bp_tok = tokens / (mode_ms["2bp"]["median"] / 1000.0) if mode_ms["2bp"] else None
    std_ratio = std_tok / t_tok if (std_tok and t_tok) else None
    ratio = bp_tok / t_tok if (bp_tok and t_tok) else None
    # torch's own form of the schedule (B, or I and W): the twobp mode that computes the same thing.
    forms = {r["form"] for r in t_ok}
    form = forms.pop() if len(forms) == 1 else None
    same_ratio = {"standard": std_ratio, "2bp": ratio}.get(form)
    # What 2BP can gain at most on these costs: the simulator's standard step over its 2BP step, each fed with
    # the costs its own mode measured (sim_step_ms), medians over the rounds.
    sim_ms = {mode: over_rounds([r["modes"].get(mode, {}).get("sim_step_ms") for r in twobp_rounds if r["ok"]])
              for mode in ("standard", "2bp")}
    bound = (sim_ms["standard"]["median"] / sim_ms["2bp"]["median"]
             if sim_ms["standard"] and sim_ms["2bp"] else None)
    of_bound = ratio / bound if (ratio and bound) else None
    label = n + (" (ref)" if n in REFERENCE_ONLY else "") + ("*" if v == 2
                                                               and SCHEDULES.get(n, ("", 0, ""))[2] == "v"
                                                               and a.patch_self_p2p else "")
    t_cell = fmt(t_tok) if t_tok else ("n/a" if n in REFERENCE_ONLY or a.no_torch else "FAILED")
    cpu = [statistics.median(c) for c in zip(*[r["cpu_ms_median_per_rank"] for r in t_ok])] if t_ok else None
    row = [label, cls, f"{twobp_name} v={v}", t_cell, fmt(std_tok), fmt(bp_tok),
           "-" if std_ratio is None else f"{std_ratio:.2f}x", "-" if ratio is None else f"{ratio:.2f}x",
           {"standard": "B", "2bp": "I+W"}.get(form, "-"),
           "-" if same_ratio is None else f"{same_ratio:.2f}x", "-" if bound is None else f"{bound:.2f}x",
           "-" if of_bound is None else f"{of_bound:.2f}",
           ms_cell(t_ms), ms_cell(mode_ms["standard"]), ms_cell(mode_ms["2bp"]),
           "/".join(fmt(c) for c in cpu) if cpu else "-"]
    record = {"schedule": n, "torch_class": cls, "twobp_schedule": twobp_name,
              "stages_per_rank": v, "torch_step_ms": t_ms, "twobp_step_ms": mode_ms,
              "torch_rounds": torch_rounds, "twobp_rounds": twobp_rounds,
              "ratio_twobp_standard_over_torch": std_ratio, "ratio_twobp_2bp_over_torch": ratio,
              "torch_form": form, "ratio_twobp_same_form_over_torch": same_ratio,
              "twobp_sim_step_ms": sim_ms, "sim_bound_2bp_over_standard": bound,
              "ratio_2bp_over_torch_of_bound": of_bound}
    print(f"[{n}] torch {fmt(t_tok)} tok/s, twobp std {fmt(std_tok)}, 2bp {fmt(bp_tok)}", file=sys.stderr,
          flush=True)
    return row, record


def parse_args():
    """The command line, checked."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                    help=f"comma-separated subset of {', '.join(list(SCHEDULES) + sorted(REFERENCE_ONLY))} "
                         "(zb-h1: twobp-only reference row)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads / --threads per rank")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per torch schedule / twobp launch")
    ap.add_argument("--twobp-bench", default="build/benchmarks/twobp_bench", help="relative to the repo root")
    ap.add_argument("--twobp-mode", default="both", choices=["both", "2bp", "standard"],
                    help="twobp modes to run (both: standard and 2bp)")
    ap.add_argument("--no-twobp", action="store_true", help="torch side only")
    ap.add_argument("--no-torch", action="store_true", help="twobp side only")
    ap.add_argument("--no-patch-self-p2p", dest="patch_self_p2p", action="store_false",
                    help="run torch's pipelining unpatched (ScheduleZBVZeroBubble then fails on gloo: its stage "
                         "warm-up sends to its own rank)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds per schedule (torch, twobp, torch, twobp, ...); medians over rounds")
    ap.add_argument("--json", help="write every number here")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")

    names = [s.strip() for s in a.schedules.split(",") if s.strip()]
    for n in names:
        if n not in SCHEDULES and n not in REFERENCE_ONLY:
            ap.error(f"unknown schedule '{n}'")
    if a.dim % a.heads or a.heads % a.kv_heads or (a.dim // a.heads) % 2:
        ap.error("dim % heads, heads % kv-heads must be 0 and head_dim even")
    return a, names


def main():
    a, names = parse_args()
    try:
        import torch  # noqa: F401 - version for the report
    except ImportError as e:  # a Python without PyTorch: say which one and how to get it, not a traceback
        sys.exit(f"torch_pipelining.py: this Python ({sys.executable}) cannot import torch ({e}); run it with the "
                 f"Python of twobp's virtual environment (.venv/bin/python, made by scripts/setup.sh) or install "
                 f"torch into this one (measured with torch 2.11)")

    load = os.getloadavg()
    print(f"torch {torch.__version__}, 2 ranks, gloo, CPU, float32, threads/rank {a.threads}; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    print(f"model: dim {a.dim}, layers {a.layers}, heads {a.heads}, kv-heads {a.kv_heads}, ffn {a.ffn}, vocab "
          f"{a.vocab}, seq {a.seq}; m {a.microbatches} x micro-batch {a.micro_batch_size}; warmup {a.warmup}, "
          f"steps {a.steps}")
    head_cost = head_cost_in_blocks(a)
    layouts = {}
    for v in (1, 2):
        counts = balance(a.layers, 2 * v, head_cost)
        layouts[v] = counts
        print(f"partition over {2 * v} stages (balanced by compute, as twobp make_partition): "
              f"{','.join(map(str, counts))} blocks")
    print("mapping: name for name (torch Schedule<Name> vs twobp <name>, same v and placement); zb-h1 (ref) = "
          f"twobp-only single-chunk ZB-H1; {a.rounds} interleaved rounds per schedule (torch, twobp, ...)")
    sys.stdout.flush()

    results = {"config": {k: getattr(a, k) for k in ("microbatches", "dim", "layers", "heads", "kv_heads", "ffn",
                                                     "vocab", "seq", "micro_batch_size", "steps", "warmup",
                                                     "threads")},
               "torch_version": torch.__version__, "load_average_start": list(load),
               "partitions": {f"{2 * v}_stages": c for v, c in layouts.items()}, "rows": []}
    rows = [["schedule", "torch class", "twobp schedule", "torch tok/s", "twobp std tok/s", "twobp 2bp tok/s",
             "std/torch", "2bp/torch", "torch form", "same form/torch", "2bp bound",
             "of bound", "torch ms (lo-hi)", "twobp std ms (lo-hi)",
             "twobp 2bp ms (lo-hi)",
             "torch cpu ms r0/r1"]]
    errors = []
    tokens = a.microbatches * a.micro_batch_size * a.seq

    for n in names:
        row, record = measure_schedule(a, n, layouts, tokens, errors)
        rows.append(row)
        results["rows"].append(record)

    shared = [r for r in results["rows"] if r["ratio_twobp_standard_over_torch"]]
    if shared:
        gm = math.exp(sum(math.log(r["ratio_twobp_standard_over_torch"]) for r in shared) / len(shared))
        results["geomean_twobp_standard_over_torch"] = gm
    same = [r for r in results["rows"] if r["ratio_twobp_same_form_over_torch"]]
    if same:
        results["geomean_twobp_same_form_over_torch"] = math.exp(
            sum(math.log(r["ratio_twobp_same_form_over_torch"]) for r in same) / len(same))
    load_end = os.getloadavg()
    results["load_average_end"] = list(load_end)
    print()
    print_table(rows)
    print(f"load average at the end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    print("tok/s = m * micro-batch size * seq / step time, the median over the rounds of each round's median step "
          "(rank 0, barrier to barrier, no optimizer step); (lo-hi) = the lowest and highest round; std/torch and "
          "2bp/torch = twobp tok/s / torch tok/s.")
    if "geomean_twobp_standard_over_torch" in results:
        print(f"geometric mean of std/torch over the {len(shared)} shared schedules: "
              f"{results['geomean_twobp_standard_over_torch']:.3f}")
    if "geomean_twobp_same_form_over_torch" in results:
        print("torch form = the backward torch's schedule runs (B: full backward; I+W: split, as twobp's 2BP mode -- "
              "its zero-bubble schedules); same form/torch = twobp in that mode over torch; geometric mean over the "
              f"{len(same)} shared schedules: {results['geomean_twobp_same_form_over_torch']:.3f}")
    print("2bp bound = twobp's simulated standard step over its simulated 2BP step (each mode's own measured costs): "
          "what 2BP can gain at most here; of bound = 2bp/torch over it.")
    print("torch cpu ms r0/r1 = median CPU time of each torch rank's process per step: compute the rank did; the "
          "rest of 'torch ms' it waited (pipeline bubbles, communication, or the OS scheduler on a busy machine).")
    if any(SCHEDULES.get(n, ("", 0, ""))[2] == "v" for n in names) and a.patch_self_p2p:
        print("*: V placement. Stock torch 2.11 fails on gloo there (a stage's warm-up posts a send/recv to its own "
              "rank, stages 1 and 2 both on rank 1); run with those self-addressed warm-up ops dropped "
              "(--no-patch-self-p2p to see the stock failure). The schedule's step is unchanged.")
    for n, side, err, tb in errors:
        print(f"ERROR [{n}] {side}: {err}")
        if tb:
            print("  " + tb.strip().splitlines()[-3].strip() if len(tb.strip().splitlines()) >= 3 else tb)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
