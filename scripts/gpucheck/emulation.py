"""The perf profile's stretch: 4 GPUs emulated in one process with green contexts (at::cuda::GreenContext in torch
2.11: a quarter of the SMs per rank thread), for a measured -- not simulated -- 2BP vs standard pipeline ratio with
real asynchrony. Not implemented: llama_pipeline has no hook that gives a rank thread a green context, so the piece
is recorded as skipped with that reason until one exists. Even then the emulation would not model shared HBM
bandwidth and L2 (the four "GPUs" share one's) or the links (no NVLink between them)."""

REASON = ("skipped: not implemented -- llama_pipeline has no hook giving each rank thread a green context "
          "(at::cuda::GreenContext, a quarter of the SMs); it has never run")


def pieces(run):
    run.add_section("green_contexts", summary)
    run.piece("measure:green_contexts", [], 1, skip_reason=REASON)


def summary():
    return {"green_contexts": {"status": "not implemented", "reason": REASON,
                               "would_not_model": "shared HBM bandwidth and L2; links (no NVLink between the parts)"}}
