"""Sizes that fit the card: the largest of a piece's candidate sizes (micro-batches m, sequence length) whose
memory, as llama_pipeline's own --dry-run estimates it, fits the GPU. The estimate is the one memory model the
project has (twobp::models::memory_model, within 1.1 % of the measured peak of whole 7B steps on an H200); this
module adds only what the estimate leaves out and the headroom."""

import json
import os
import shlex

# Of the card's memory the estimates may fill. Why not all: the caching allocator reserves more than its allocated
# peak (fragmentation), the estimate leaves out message buffers, and the measured peak was 1.011 x the estimate.
FIT_SHARE = 0.85
# Per process on the GPU, outside the allocator's statistics and so outside the estimate: the CUDA context, cuBLAS
# workspaces, NCCL's buffers. An allowance, not a measurement.
PROCESS_OVERHEAD_GIB = 1.0
# The H100 SXM's memory as torch reports it (80 GB = 81559 MiB): every choice also says whether it would fit one.
H100_GIB = 79.6


def need_gib(rank_bytes, processes):
    """GiB the GPU must hold for ranks whose estimates are rank_bytes, all on the one GPU, in `processes`
    processes."""
    return sum(rank_bytes) / 2**30 + processes * PROCESS_OVERHEAD_GIB


def fits(need, card_gib):
    return need <= FIT_SHARE * card_gib


def verdict(need, card_gib, last):
    """Whether a candidate needing `need` GiB is taken on a card of card_gib GiB (None: unknown), and why. With
    the memory unknown only the last (smallest) candidate is taken."""
    if card_gib is None:
        return last, "the card's memory is unknown: %s" % ("the smallest candidate" if last else "trying a smaller")
    if fits(need, card_gib):
        return True, "%.1f GiB needed <= %.2f x %.1f GiB" % (need, FIT_SHARE, card_gib)
    return False, "%.1f GiB needed > %.2f x %.1f GiB%s" % (need, FIT_SHARE, card_gib,
                                                          "" if last else ": trying a smaller size")


def estimate_command(configs, tmp, tag):
    """One shell command running llama_pipeline --dry-run for each (label, command) of configs, each writing its
    plan JSON into tmp; returns (command, {label: path})."""
    paths, lines = {}, ["set -ex"]
    for label, cmd in configs:
        paths[label] = os.path.join(tmp, "estimate_%s_%s.json" % (tag, label))
        lines.append(" ".join(shlex.quote(str(c)) for c in list(cmd) + ["--dry-run", "--json", paths[label]]))
    return ["sh", "-c", "\n".join(lines)], paths


def rank_bytes(path):
    """Each rank's estimated peak bytes from a --dry-run --json plan."""
    with open(path) as f:
        return [float(r["memory_bytes"]) for r in json.load(f)["ranks"]]


class Sizer:
    """Runs the estimate pieces of one measurement: for each candidate (largest first) a piece
    `<prefix>_size_m<M>_seq<S>` with the dry runs of every config, until one fits. chosen is then
    {m, seq, need_gib, estimates: {label: [bytes per rank]}, ...}; None if none fit or the pieces failed."""

    def __init__(self, run, env, prefix, processes):
        self.run, self.env, self.prefix, self.processes = run, env, prefix, processes
        self.chosen = None
        self.tried = []

    def card_gib(self, dry_card_gib):
        return dry_card_gib if self.run.dry else self.env.card_gib()

    def pieces(self, candidates, configs_of, dry_card_gib, required, skip_reason=None, needs=()):
        """candidates: [(m, seq)] largest first; configs_of(m, seq) -> [(label, llama_pipeline command)];
        required: the labels whose need decides (others, e.g. an optional mixed-precision run, are only
        estimated)."""
        run = self.run
        card = self.card_gib(dry_card_gib)
        for k, (m, seq) in enumerate(candidates):
            name = "%s_size_m%d_seq%d" % (self.prefix, m, seq)
            cmd, paths = estimate_command(configs_of(m, seq), run.tmp, name.replace(":", "_"))
            result = {}

            def judge(text, rc, killed, status, detail, paths=paths, result=result, m=m, seq=seq, k=k):
                if status != "pass":
                    return status, detail, None
                estimates = {label: rank_bytes(p) for label, p in paths.items()}
                needs_gib = {label: round(need_gib(b, self.processes), 2) for label, b in estimates.items()}
                need = max(needs_gib[label] for label in required)
                taken, why = verdict(need, card, k == len(candidates) - 1)
                result.update(m=m, seq=seq, need_gib=need, needs_gib=needs_gib, estimates=estimates,
                              fits=taken, fits_h100_80gb=fits(need, H100_GIB), why=why)
                return "pass", "m %d, seq %d: %s" % (m, seq, why), None

            piece, _ = run.piece(name, cmd, 60, min_s=5, analyze=judge, skip_reason=skip_reason, needs=needs)
            if piece["status"] != "pass" or not result:
                return None
            self.tried.append({key: v for key, v in result.items() if key != "estimates"})
            if result["fits"]:
                self.chosen = dict(result, card_gib=card, gpu=None if run.dry else self.env.gpu_name(),
                                   fit_share=FIT_SHARE, process_overhead_gib=PROCESS_OVERHEAD_GIB,
                                   processes=self.processes)
                return self.chosen
        return None

    def summary(self):
        return {"chosen": self.chosen, "tried": self.tried,
                "rule": "the first of the candidates (largest first) whose llama_pipeline --dry-run estimate, plus "
                        "%.1f GiB per process, fits %.2f of the card's memory" % (PROCESS_OVERHEAD_GIB, FIT_SHARE)}
