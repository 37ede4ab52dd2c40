#pragma once
// The run document: what runs were (model shape, placement, partition, backward mode, replicas) and what they
// measured (per-stage costs), with one writer and one reader. `twobp_bench pipeline --json` and `llama_pipeline
// --costs-json` write it; `twobp_bench simulate --from-json` and `twobp_bench plan --costs-json` read it.
//
//   {"config":  {"model": "llama", "dim", "layers", "heads", "kv_heads", "ffn", "vocab", "seq",
//                "micro_batch_size", ...},
//    "results": [{"schedule", "mode", "p", "m", "v", "partition"?, "dp"?, "memory_limit_bytes"?, "shapes"?,
//                 "communication_ms", "costs_ms", "overlap"?, ...}, ...]}
//
// "...": a program's further fields (RunDocument::config_extra, RunRecord::extra), kept as given. The costs' own form
// is measure.h's (measured_costs_json / parse_measured_costs). The partner rule (costs of one backward mode taken
// from a result of the other) lives here too: a 2BP result holds I and W, a standard one B.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "twobp/plan/measure.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"

namespace twobp {

/// The measured model's shape ("config"). A size the model does not have (resnet has no vocab) is 0.
struct ModelShape {
  std::string model = "llama";  ///< llama, bert, resnet; empty: a document without "config" (costs only)
  int64_t dim = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, seq = 0, micro_batch_size = 0;
};

/// One measured run of a schedule ("results" entry).
struct RunRecord {
  std::string schedule;
  BackwardMode mode = BackwardMode::kSplit;
  int p = 0, m = 0, v = 0;        ///< pipeline ranks, micro-batches per step, chunks per rank
  std::string partition;          ///< blocks per stage ("3,1", models::Partition::layout()); empty: balanced
  int replicas = 1;               ///< data-parallel replicas ("dp", written when > 1; "replicas" read as an alias)
  int64_t memory_limit_bytes = 0; ///< ExecutorOptions::memory_limit_bytes of the run; 0: none (not written)
  std::string shapes;             ///< "fixed" or "announced" where the run said; empty: fixed (not written)
  MeasuredCosts costs;            ///< per stage, agreed over the pipeline; the mode's own backward costs > 0
  /// Further fields, a JSON object's text. A field the record holds too (a program's "schedule" column) takes the
  /// record's value at the extra's place, so a program keeps its own key order; the others follow.
  std::string extra = "{}";

  /// Costs fit to plan from: measured without a memory limit and with fixed shapes.
  bool plain() const { return memory_limit_bytes == 0 && shapes != "announced"; }
};

/// A program's run document.
struct RunDocument {
  ModelShape model;
  std::string config_extra = "{}";  ///< further "config" fields (JSON object text), ordered as RunRecord::extra
  std::vector<RunRecord> results;
};

/// The one writer: the document as JSON text (indented by `indent`, < 0: one line).
std::string write_run_document(const RunDocument& doc, int indent = 2);

/// The one reader. "config" may be missing (a document of costs only: model ""). Throws UsageError naming `where`
/// (a file name), each with its own message: "<where>: not a run document: " and invalid JSON (with nlohmann's line
/// and column), a number out of range of a double (1e400), no object, no "results", or "results" / "config" of the
/// wrong type; "<where>: result <k>: " and the field when a result lacks schedule, mode, p, m, v or its costs, a
/// cost is refused by check_measured_costs (negative, above 1e9 ms), an integer is out of range, or a mode or
/// shapes value is unknown. Fields it does not know go to the extras.
RunDocument read_run_document(const std::string& text, const std::string& where);
/// read_run_document of a file's contents; UsageError when it cannot be read.
RunDocument read_run_document_file(const std::string& path);

/// Documents of the same model as one: the first's config, every document's results in order. Throws UsageError
/// naming two of `names` (one per document) when their model, sizes, seq or micro_batch_size differ.
RunDocument merge_run_documents(const std::vector<RunDocument>& docs, const std::vector<std::string>& names);

/// The partner of results[index]: the last other result of the same schedule, p, m, v, replicas, memory limit and
/// shapes in the other backward mode; nullptr when there is none.
const RunRecord* find_partner(const RunDocument& doc, std::size_t index);

/// The partner rule: `record`'s costs completed so that both modes can be simulated. I and W (with W0) come from
/// `partner` (may be nullptr) where the record has none; B from the partner where the record has none and the
/// partner has some, else B = I + W0 + W per stage (CostModel::unfused_backward). `note` (if given) gets what was
/// taken from where. Throws UsageError when neither has I/W costs (measure a 2BP run) or the sizes differ.
MeasuredCosts complete_costs(const RunRecord& record, const RunRecord* partner, std::string* note = nullptr);

/// The backward modes whose costs `record` measured: its own mode, and the other mode too when that mode's costs are
/// > 0 on every stage (a run that measured both, as `llama_pipeline --schedule auto` does, writes one record).
std::vector<BackwardMode> measured_modes(const RunRecord& record);
/// The mode to record `costs` under (RunRecord::mode): kSplit when I and W are > 0 on every stage (a 2BP run; its
/// B's too where it measured them: measured_modes then lists both), else kStandard when B is, else nullopt (write
/// no record: a stage without costs would read as free to a fit or a simulation).
std::optional<BackwardMode> measured_mode(const MeasuredCosts& costs);

/// Measured per-stage costs of a placement (`measured_stage_to_rank`, stage -> rank) as the costs of another
/// schedule `target`: each stage keeps its cost when the ranks and placement are the same ("per-stage"); with the
/// same ranks, a chunk on rank r costs the sum of the measured stages of rank r / v ("per-rank / v"); with other
/// ranks, every chunk costs the mean measured rank's total / v ("mean-rank / v": a model that grows with the ranks,
/// every rank holding as much work as a measured one). F, I, W, B and W0 map alike; communication and overlap are
/// kept; recompute is left empty. `rule` (if given) gets the rule's name. Throws UsageError when the placement's
/// size is not the costs' stage count.
CostModel costs_for_placement(const MeasuredCosts& measured, const std::vector<int>& measured_stage_to_rank,
                              const Schedule& target, std::string* rule = nullptr);

}  // namespace twobp
