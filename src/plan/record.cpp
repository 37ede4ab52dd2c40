#include "twobp/plan/record.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>
#include <utility>

#include "twobp/error.h"
#include "twobp/schedule/simulate.h"
#include "util/check.h"
#include "util/positive.h"

namespace twobp {

using detail::any_positive;
using detail::every_positive;
namespace {

using Json = nlohmann::ordered_json;

// The shape's fields, in the order they are written.
const std::pair<const char*, int64_t ModelShape::*> kShapeFields[] = {
    {"dim", &ModelShape::dim},     {"layers", &ModelShape::layers}, {"heads", &ModelShape::heads},
    {"kv_heads", &ModelShape::kv_heads}, {"ffn", &ModelShape::ffn}, {"vocab", &ModelShape::vocab},
    {"seq", &ModelShape::seq},     {"micro_batch_size", &ModelShape::micro_batch_size}};

// The record's own fields: the reader takes them out of the extras.
const char* const kRecordKeys[] = {"schedule", "mode",        "p",                  "m",      "v",
                                   "partition", "dp",         "replicas",           "memory_limit_bytes",
                                   "shapes",    "communication_ms", "costs_ms",     "overlap"};

Json object_of(const std::string& text, const std::string& what) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  TWOBP_CHECK(j.is_object(), UsageError, "{}: not a JSON object: {}", what, text.substr(0, 80));
  return j;
}

// `own` placed into `extra`'s order: extra's keys in order (own's value where it has the key), then own's others.
Json merged(const Json& own, const Json& extra) {
  Json out = Json::object();
  for (auto it = extra.begin(); it != extra.end(); ++it) out[it.key()] = own.contains(it.key()) ? own[it.key()] : *it;
  for (auto it = own.begin(); it != own.end(); ++it) {
    if (!out.contains(it.key())) out[it.key()] = *it;
  }
  return out;
}

Json record_json(const RunRecord& r) {
  Json j = {{"schedule", r.schedule}, {"mode", to_string(r.mode)}, {"p", r.p}, {"m", r.m}, {"v", r.v}};
  if (!r.partition.empty()) j["partition"] = r.partition;
  if (r.replicas > 1) j["dp"] = r.replicas;
  if (r.memory_limit_bytes > 0) j["memory_limit_bytes"] = r.memory_limit_bytes;
  if (!r.shapes.empty()) j["shapes"] = r.shapes;
  const Json costs = Json::parse(measured_costs_json(r.costs));
  for (auto it = costs.begin(); it != costs.end(); ++it) j[it.key()] = *it;
  return merged(j, object_of(r.extra, "RunRecord::extra"));
}

int64_t integer(const Json& j, const char* key, int64_t min, const std::string& where) {
  TWOBP_CHECK(j.contains(key), UsageError, "{}: has no \"{}\"", where, key);
  const Json& x = j[key];
  TWOBP_CHECK(x.is_number_integer() && x.get<int64_t>() >= min, UsageError,
              "{}: \"{}\" must be an integer >= {}, got {}", where, key, min, x.dump());
  return x.get<int64_t>();
}

std::string text(const Json& j, const char* key, const std::string& where) {
  TWOBP_CHECK(j.contains(key) && j[key].is_string(), UsageError, "{}: \"{}\" must be a string{}", where, key,
              j.contains(key) ? ", got " + j[key].dump() : " (missing)");
  return j[key].get<std::string>();
}

RunRecord read_record(const Json& j, const std::string& where) {
  TWOBP_CHECK(j.is_object(), UsageError, "{}: not a JSON object", where);
  RunRecord r;
  r.schedule = text(j, "schedule", where);
  try {
    r.mode = parse_backward_mode(text(j, "mode", where));
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", where, e.what()));
  }
  r.p = static_cast<int>(integer(j, "p", 1, where));
  r.m = static_cast<int>(integer(j, "m", 1, where));
  r.v = static_cast<int>(integer(j, "v", 1, where));
  if (j.contains("partition")) r.partition = text(j, "partition", where);
  if (j.contains("dp")) r.replicas = static_cast<int>(integer(j, "dp", 1, where));
  if (j.contains("replicas")) r.replicas = static_cast<int>(integer(j, "replicas", 1, where));  // older name
  if (j.contains("memory_limit_bytes")) r.memory_limit_bytes = integer(j, "memory_limit_bytes", 0, where);
  if (j.contains("shapes")) {
    r.shapes = text(j, "shapes", where);
    TWOBP_CHECK(r.shapes == "fixed" || r.shapes == "announced", UsageError,
                "{}: \"shapes\" must be \"fixed\" or \"announced\", got \"{}\"", where, r.shapes);
  }
  r.costs = parse_measured_costs(j.dump(), where);
  TWOBP_CHECK(r.costs.num_stages() == r.p * r.v, UsageError,
              "{}: costs of {} stages, but p = {} ranks of v = {} chunks make {}", where, r.costs.num_stages(), r.p,
              r.v, r.p * r.v);
  Json extra = j;
  for (const char* key : kRecordKeys) extra.erase(key);
  r.extra = extra.dump();
  return r;
}

// nlohmann's message without its "[json.exception.parse_error.101] " prefix.
std::string nlohmann_message(const nlohmann::json::exception& e) {
  const std::string m = e.what();
  const std::size_t end = m.find("] ");
  return end == std::string::npos ? m : m.substr(end + 2);
}

// The document's JSON: UsageError "<where>: not a run document: <why>" for text that is no JSON (where it breaks),
// a number past the largest double, no object, or an object without a "results" list or with a "config" of
// another type.
Json document_json(const std::string& text_in, const std::string& where) {
  const std::string what = fmt::format("{}: not a run document", where);
  const char* form = "(a JSON object with a \"results\" list and a \"config\" object, as `twobp_bench pipeline "
                     "--json` and `llama_pipeline --costs-json` write)";
  Json j;
  try {
    j = Json::parse(text_in);
  } catch (const nlohmann::json::out_of_range& e) {  // 406: a number past the largest double, as 1e400
    detail::raise<UsageError>("{}: a number is out of range ({}) {}", what, nlohmann_message(e), form);
  } catch (const nlohmann::json::exception& e) {  // parse_error: where the text stops being JSON
    detail::raise<UsageError>("{}: invalid JSON ({}) {}", what, nlohmann_message(e), form);
  }
  TWOBP_CHECK(j.is_object(), UsageError, "{}: the JSON is of type {}, not an object {}", what, j.type_name(), form);
  TWOBP_CHECK(!j.contains("config") || j["config"].is_object(), UsageError,
              "{}: \"config\" is of type {}, not an object {}", what, j["config"].type_name(), form);
  TWOBP_CHECK(j.contains("results"), UsageError, "{}: no \"results\" {}", what, form);
  TWOBP_CHECK(j["results"].is_array(), UsageError, "{}: \"results\" is of type {}, not a list {}", what,
              j["results"].type_name(), form);
  return j;
}

}  // namespace

std::string write_run_document(const RunDocument& doc, int indent) {
  Json config = {{"model", doc.model.model}};
  for (const auto& [key, field] : kShapeFields) config[key] = doc.model.*field;
  Json out;
  out["config"] = merged(config, object_of(doc.config_extra, "RunDocument::config_extra"));
  out["results"] = Json::array();
  for (const RunRecord& r : doc.results) out["results"].push_back(record_json(r));
  return out.dump(indent);
}

RunDocument read_run_document(const std::string& text_in, const std::string& where) {
  const Json j = document_json(text_in, where);
  RunDocument doc;
  const Json config = j.value("config", Json::object());
  doc.model.model = j.contains("config") ? text(config, "model", where + ": config") : "";
  Json extra = config;
  extra.erase("model");
  for (const auto& [key, field] : kShapeFields) {
    if (config.contains(key)) doc.model.*field = integer(config, key, 0, where + ": config");
    extra.erase(key);
  }
  doc.config_extra = extra.dump();
  for (std::size_t k = 0; k < j["results"].size(); ++k) {
    doc.results.push_back(read_record(j["results"][k], fmt::format("{}: result {}", where, k)));
  }
  return doc;
}

RunDocument read_run_document_file(const std::string& path) {
  std::ifstream in(path);
  TWOBP_CHECK(in.good(), UsageError, "{}: cannot open the run document", path);
  std::stringstream text;
  text << in.rdbuf();
  return read_run_document(text.str(), path);
}

RunDocument merge_run_documents(const std::vector<RunDocument>& docs, const std::vector<std::string>& names) {
  TWOBP_CHECK(!docs.empty() && docs.size() == names.size(), UsageError,
              "merge_run_documents: {} documents and {} names (one name each, at least one)", docs.size(),
              names.size());
  RunDocument out = docs.front();
  for (std::size_t d = 1; d < docs.size(); ++d) {
    const ModelShape &first = out.model, &mine = docs[d].model;
    TWOBP_CHECK(mine.model == first.model, UsageError,
                "{} measured model {} and {} measured {}: the files must measure the same model, sequence length "
                "and micro-batch size",
                names.front(), first.model, names[d], mine.model);
    for (const auto& [key, field] : kShapeFields) {
      TWOBP_CHECK(mine.*field == first.*field, UsageError,
                  "{} measured {} {} and {} measured {}: the files must measure the same model, sequence length "
                  "and micro-batch size",
                  names.front(), key, first.*field, names[d], mine.*field);
    }
    out.results.insert(out.results.end(), docs[d].results.begin(), docs[d].results.end());
  }
  return out;
}

std::optional<BackwardMode> measured_mode(const MeasuredCosts& costs) {
  if (every_positive(costs.backward_input) && every_positive(costs.backward_weight)) return BackwardMode::kSplit;
  if (every_positive(costs.backward)) return BackwardMode::kStandard;
  return std::nullopt;
}

const RunRecord* find_partner(const RunDocument& doc, std::size_t index) {
  TWOBP_CHECK(index < doc.results.size(), UsageError, "find_partner: result {} of {}", index, doc.results.size());
  const RunRecord& r = doc.results[index];
  const RunRecord* partner = nullptr;
  for (const RunRecord& o : doc.results) {
    if (o.schedule == r.schedule && o.p == r.p && o.m == r.m && o.v == r.v && o.mode != r.mode &&
        o.replicas == r.replicas && o.memory_limit_bytes == r.memory_limit_bytes && o.plain() == r.plain()) {
      partner = &o;
    }
  }
  return partner;
}

MeasuredCosts complete_costs(const RunRecord& record, const RunRecord* partner, std::string* note) {
  MeasuredCosts c = record.costs;
  std::string said;
  const std::size_t S = c.forward.size();
  if (!any_positive(c.backward_input) && partner != nullptr && any_positive(partner->costs.backward_input)) {
    c.backward_input = partner->costs.backward_input;
    c.backward_weight = partner->costs.backward_weight;
    c.backward_weight_fixed = partner->costs.backward_weight_fixed;
    said += " I,W from its 2bp partner;";
  }
  TWOBP_CHECK(any_positive(c.backward_input), UsageError,
              "{} {} p={} v={}: no I/W costs and no 2bp partner result (measure a 2bp run, e.g. `twobp_bench "
              "pipeline --mode both`)",
              record.schedule, to_string(record.mode), record.p, record.v);
  if (!any_positive(c.backward) && partner != nullptr && any_positive(partner->costs.backward)) {
    c.backward = partner->costs.backward;
    said += " B from its standard partner;";
  }
  TWOBP_CHECK(c.backward_input.size() == S && c.backward_weight.size() == S && c.backward.size() == S, UsageError,
              "{} {}: costs of {} stages (F), {} (I), {} (W), {} (B) with its partner's: one per stage",
              record.schedule, to_string(record.mode), S, c.backward_input.size(), c.backward_weight.size(),
              c.backward.size());
  if (!any_positive(c.backward)) {
    CostModel parts;  // the split parts, for the simulator's fused-B rule
    parts.backward_input = c.backward_input;
    parts.backward_weight = c.backward_weight;
    parts.backward_weight_fixed = c.backward_weight_fixed;
    for (std::size_t s = 0; s < S; ++s) c.backward[s] = parts.unfused_backward(static_cast<int>(s));
    said += " B = I + W (no standard result);";
  }
  if (note != nullptr) *note = said;
  return c;
}

std::vector<BackwardMode> measured_modes(const RunRecord& record) {
  std::vector<BackwardMode> modes{record.mode};
  const MeasuredCosts& c = record.costs;
  if (record.mode == BackwardMode::kSplit && every_positive(c.backward)) modes.push_back(BackwardMode::kStandard);
  if (record.mode == BackwardMode::kStandard && every_positive(c.backward_input) &&
      every_positive(c.backward_weight)) {
    modes.push_back(BackwardMode::kSplit);
  }
  return modes;
}

CostModel costs_for_placement(const MeasuredCosts& m, const std::vector<int>& measured_stage_to_rank,
                              const Schedule& target, std::string* rule) {
  const std::size_t measured_stages = m.forward.size();
  TWOBP_CHECK(measured_stage_to_rank.size() == measured_stages && measured_stages > 0, UsageError,
              "costs_for_placement: {} measured stage costs, a placement of {} stages", measured_stages,
              measured_stage_to_rank.size());
  const int S = target.num_stages, P = target.num_ranks;
  const int measured_p = *std::max_element(measured_stage_to_rank.begin(), measured_stage_to_rank.end()) + 1;
  const double v = static_cast<double>(S) / P;
  // Per stage: F, I, W, B, W0.
  using Row = std::array<double, 5>;
  auto measured = [&](std::size_t s) -> Row {
    return {m.forward[s], m.backward_input[s], m.backward_weight[s], m.backward[s],
            m.backward_weight_fixed.empty() ? 0.0 : m.backward_weight_fixed[s]};
  };
  std::vector<Row> rank(measured_p, Row{});  // per measured rank, its stages' sums
  Row mean{};                                // the mean measured rank's
  for (std::size_t s = 0; s < measured_stages; ++s) {
    for (std::size_t k = 0; k < 5; ++k) {
      rank[measured_stage_to_rank[s]][k] += measured(s)[k];
      mean[k] += measured(s)[k] / measured_p;
    }
  }
  const bool same_placement = P == measured_p && target.stage_to_rank == measured_stage_to_rank;
  const std::string name = same_placement ? "per-stage" : P == measured_p ? "per-rank / v" : "mean-rank / v";
  CostModel c = CostModel::uniform(S, 0, 0, 0, m.communication);
  c.overlap = m.overlap;
  c.backward.resize(S);
  if (!m.backward_weight_fixed.empty()) c.backward_weight_fixed.resize(S);
  for (int s = 0; s < S; ++s) {
    Row x = same_placement ? measured(s) : P == measured_p ? rank[target.stage_to_rank[s]] : mean;
    if (!same_placement) {
      for (double& value : x) value /= v;
    }
    c.forward[s] = x[0];
    c.backward_input[s] = x[1];
    c.backward_weight[s] = x[2];
    c.backward[s] = x[3];
    if (!c.backward_weight_fixed.empty()) c.backward_weight_fixed[s] = x[4];
  }
  if (rule != nullptr) *rule = name;
  return c;
}

}  // namespace twobp
