// The run document (twobp/plan/record.h): what is written reads back the same, a program's extra fields keep their
// place, malformed documents are refused naming what is wrong, and the partner rule completes a mode's costs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "twobp/error.h"
#include "twobp/plan/record.h"

namespace twobp {
namespace {

MeasuredCosts costs(std::vector<double> f, std::vector<double> i, std::vector<double> w, std::vector<double> b) {
  MeasuredCosts c;
  c.forward = std::move(f);
  c.backward_input = std::move(i);
  c.backward_weight = std::move(w);
  c.backward = std::move(b);
  c.communication = 0.25;
  return c;
}

RunRecord record(BackwardMode mode, MeasuredCosts c) {
  RunRecord r;
  r.schedule = "1f1b";
  r.mode = mode;
  r.p = 2;
  r.m = 4;
  r.v = 1;
  r.costs = std::move(c);
  return r;
}

RunDocument document() {
  RunDocument doc;
  doc.model = ModelShape{"llama", 64, 4, 4, 2, 128, 256, 32, 2};
  doc.config_extra = R"({"source":"test","steps":3})";
  RunRecord split = record(BackwardMode::kSplit, costs({1, 2}, {3, 4}, {5, 6}, {0, 0}));
  split.partition = "3,1";
  split.replicas = 2;
  split.costs.recompute = {0.5, 0.5};
  split.costs.backward_weight_fixed = {0.1, 0.2};
  split.costs.overlap = 0.3;
  split.costs.overlapped_pairs = 4;
  split.extra = R"({"tokens_per_s":10.5,"attribution":[{"rank":0}]})";
  RunRecord standard = record(BackwardMode::kStandard, costs({1, 2}, {0, 0}, {0, 0}, {7, 8}));
  standard.memory_limit_bytes = 1 << 20;
  standard.shapes = "announced";
  doc.results = {split, standard};
  return doc;
}

TEST(RunDocument, RoundTrips) {
  const RunDocument doc = document();
  const std::string text = write_run_document(doc);
  const RunDocument back = read_run_document(text, "doc");
  EXPECT_EQ(write_run_document(back), text);
  EXPECT_EQ(back.model.dim, 64);
  EXPECT_EQ(back.model.micro_batch_size, 2);
  ASSERT_EQ(back.results.size(), 2u);
  const RunRecord& r = back.results[0];
  EXPECT_EQ(r.mode, BackwardMode::kSplit);
  EXPECT_EQ(r.partition, "3,1");
  EXPECT_EQ(r.replicas, 2);
  EXPECT_EQ(r.costs.backward_weight, (std::vector<double>{5, 6}));
  EXPECT_EQ(r.costs.backward_weight_fixed, (std::vector<double>{0.1, 0.2}));
  EXPECT_EQ(r.costs.recompute, (std::vector<double>{0.5, 0.5}));
  EXPECT_DOUBLE_EQ(r.costs.overlap, 0.3);
  EXPECT_DOUBLE_EQ(r.costs.communication, 0.25);
  EXPECT_TRUE(r.plain());
  EXPECT_EQ(back.results[1].memory_limit_bytes, 1 << 20);
  EXPECT_FALSE(back.results[1].plain());
  EXPECT_NE(text.find("\"tokens_per_s\""), std::string::npos);
  EXPECT_NE(text.find("\"source\": \"test\""), std::string::npos);
}

TEST(RunDocument, ExtraFieldsKeepTheirPlaceAndTheRecordsValues) {
  RunDocument doc = document();
  doc.results.resize(1);
  // A program's columns in its own order, "schedule" among them with a stale value: the record's value wins there.
  doc.results[0].extra = R"({"rank_first":1,"schedule":"stale","mode":"x","p":0,"m":0,"v":0,"last":2})";
  const std::string text = write_run_document(doc, -1);
  const std::size_t first = text.find("rank_first"), schedule = text.find("\"schedule\":\"1f1b\""),
                    last = text.find("\"last\""), costs = text.find("costs_ms");
  ASSERT_NE(schedule, std::string::npos) << text;
  EXPECT_LT(first, schedule);
  EXPECT_LT(schedule, last);
  EXPECT_LT(last, costs);  // the record's fields the extra does not place come after it
  EXPECT_EQ(text.find("stale"), std::string::npos);
}

TEST(RunDocument, ReadsADocumentOfCostsOnly) {
  const RunDocument doc = read_run_document(
      R"({"results":[{"schedule":"1f1b","mode":"standard","p":1,"m":2,"v":1,"communication_ms":0,
          "costs_ms":{"F":[1],"B":[2]}}]})",
      "costs only");
  EXPECT_EQ(doc.model.model, "");
  EXPECT_EQ(doc.results[0].costs.backward, (std::vector<double>{2}));
}

TEST(RunDocument, ReadsTheOlderReplicasName) {
  const RunDocument doc = read_run_document(
      R"({"config":{"model":"llama"},"results":[{"schedule":"1f1b","mode":"2bp","p":1,"m":2,"v":1,"replicas":3,
          "communication_ms":0,"costs_ms":{"F":[1],"I":[1],"W":[1]}}]})",
      "old");
  EXPECT_EQ(doc.results[0].replicas, 3);
  EXPECT_EQ(write_run_document(doc).find("replicas"), std::string::npos);  // written as "dp"
}

void expect_refused(const std::string& text, const std::string& says) {
  try {
    read_run_document(text, "bad.json");
    FAIL() << "accepted: " << text;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
  }
}

TEST(RunDocument, RefusesMalformedDocuments) {
  const std::string costs = R"("communication_ms":0,"costs_ms":{"F":[1,1],"I":[1,1],"W":[1,1]})";
  expect_refused("not json", "not a run document");
  expect_refused(R"({"config":{"model":"llama"}})", "not a run document");
  expect_refused(R"({"config":{"model":"llama"},"results":{}})", "not a run document");
  expect_refused(R"({"config":{},"results":[]})", "\"model\" must be a string");
  expect_refused(R"({"config":[],"results":[]})", "not a run document");
  expect_refused(R"({"config":{"model":"llama","dim":-1},"results":[]})", "\"dim\" must be an integer >= 0");
  expect_refused(R"({"config":{"model":"llama"},"results":[3]})", "result 0: not a JSON object");
  expect_refused(R"({"config":{"model":"llama"},"results":[{"mode":"2bp","p":2,"m":2,"v":1,)" + costs + "}]}",
                 "\"schedule\" must be a string");
  expect_refused(R"({"config":{"model":"llama"},"results":[{"schedule":"1f1b","mode":"3bp","p":2,"m":2,"v":1,)" +
                     costs + "}]}",
                 "unknown backward mode '3bp'");
  expect_refused(R"({"config":{"model":"llama"},"results":[{"schedule":"1f1b","mode":"2bp","p":0,"m":2,"v":1,)" +
                     costs + "}]}",
                 "\"p\" must be an integer >= 1");
  expect_refused(R"({"config":{"model":"llama"},"results":[{"schedule":"1f1b","mode":"2bp","p":2,"m":2,"v":1}]})",
                 "costs_ms");
  expect_refused(R"({"config":{"model":"llama"},"results":[{"schedule":"1f1b","mode":"2bp","p":3,"m":2,"v":1,)" +
                     costs + "}]}",
                 "costs of 2 stages, but p = 3");
  expect_refused(R"({"config":{"model":"llama"},"results":[{"schedule":"1f1b","mode":"2bp","p":2,"m":2,"v":1,)"
                 R"("shapes":"odd",)" + costs + "}]}",
                 "\"shapes\" must be");
}

// Issue 69: each way a text fails to be a run document has its own message (invalid JSON with where it breaks, a
// number past the largest double, no object, no "results"), and a cost that is no cost names the file, the result
// and the field: negative, or huge (W = 1e308, which `twobp_bench plan --costs-json` planned a finite step from).
// NaN and infinities cannot be written in JSON: they are invalid JSON.
TEST(RunDocument, SaysWhyATextIsNotARunDocument) {
  expect_refused(R"({"config":{"model":"llama"},"results":[)", "not a run document: invalid JSON (");
  expect_refused(R"({"config":{"model":"llama"},"results":[]} x)", "line 1, column");
  expect_refused(R"({"results":[{"communication_ms":1e400}]})", "not a run document: a number is out of range");
  expect_refused(R"([1, 2])", "not a run document: the JSON is of type array, not an object");
  expect_refused(R"({"config":{"model":"llama"}})", "not a run document: no \"results\"");
  expect_refused(R"({"results":{}})", "not a run document: \"results\" is of type object, not a list");
  expect_refused(R"({"config":[],"results":[]})", "not a run document: \"config\" is of type array");
  const std::string head = R"({"results":[{"schedule":"1f1b","mode":"2bp","p":2,"m":2,"v":1,"communication_ms":0,)";
  for (const std::string& bad : {"-1", "1e308", "1e10", "-0.5"}) {
    expect_refused(head + R"("costs_ms":{"F":[1,1],"I":[1,1],"W":[1,)" + bad + "]}}]}",
                   "bad.json: result 0: costs_ms.W[1] is ");
    expect_refused(head.substr(0, head.find("\"communication_ms\"")) + R"("communication_ms":)" + bad +
                       R"(,"costs_ms":{"F":[1,1],"I":[1,1],"W":[1,1]}}]})",
                   "bad.json: result 0: communication_ms is ");
  }
  for (const std::string& bad : {"NaN", "nan", "Infinity", "-Infinity", "inf"}) {
    expect_refused(head + R"("costs_ms":{"F":[1,1],"I":[1,1],"W":[1,)" + bad + "]}}]}", "invalid JSON");
  }
  // A record whose lists differ in length names the file and the result.
  expect_refused(head + R"("costs_ms":{"F":[1,1],"I":[1,1,1],"W":[1,1]}}]})",
                 "bad.json: result 0: costs_ms.I has 3 stages, costs_ms.F has 2");
}

TEST(RunDocument, MergesDocumentsOfOneModelOnly) {
  const RunDocument a = document();
  RunDocument b = document();
  EXPECT_EQ(merge_run_documents({a, b}, {"a", "b"}).results.size(), 4u);
  b.model.seq = 16;
  try {
    merge_run_documents({a, b}, {"a.json", "b.json"});
    FAIL() << "merged documents of two sequence lengths";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("a.json measured seq 32 and b.json measured 16"), std::string::npos)
        << e.what();
  }
}

TEST(PartnerRule, CompletesEachModeFromTheOther) {
  RunDocument doc = document();
  doc.results[1].memory_limit_bytes = 0;  // the same variant as the 2bp result: partners
  doc.results[1].shapes.clear();
  doc.results[1].replicas = 2;
  ASSERT_EQ(find_partner(doc, 0), &doc.results[1]);
  ASSERT_EQ(find_partner(doc, 1), &doc.results[0]);
  std::string note;
  const MeasuredCosts standard = complete_costs(doc.results[1], find_partner(doc, 1), &note);
  EXPECT_EQ(standard.backward_input, (std::vector<double>{3, 4}));
  EXPECT_EQ(standard.backward, (std::vector<double>{7, 8}));
  EXPECT_NE(note.find("I,W from its 2bp partner"), std::string::npos);
  const MeasuredCosts split = complete_costs(doc.results[0], find_partner(doc, 0), &note);
  EXPECT_EQ(split.backward, (std::vector<double>{7, 8}));
  EXPECT_NE(note.find("B from its standard partner"), std::string::npos);
  // Alone: B = I + W0 + W; a standard result alone has no I/W and is refused.
  const MeasuredCosts alone = complete_costs(doc.results[0], nullptr, &note);
  EXPECT_DOUBLE_EQ(alone.backward[0], 3 + 0.1 + 5);
  EXPECT_NE(note.find("B = I + W"), std::string::npos);
  EXPECT_THROW(complete_costs(doc.results[1], nullptr), UsageError);
  // Another variant (memory limit) is no partner.
  doc.results[1].memory_limit_bytes = 1;
  EXPECT_EQ(find_partner(doc, 0), nullptr);
}

TEST(PartnerRule, ARecordOfBothModesMeasuredBoth) {
  EXPECT_EQ(measured_modes(record(BackwardMode::kSplit, costs({1}, {1}, {1}, {0}))),
            (std::vector<BackwardMode>{BackwardMode::kSplit}));
  EXPECT_EQ(measured_modes(record(BackwardMode::kSplit, costs({1, 1}, {1, 1}, {1, 1}, {2, 2}))),
            (std::vector<BackwardMode>{BackwardMode::kSplit, BackwardMode::kStandard}));
  EXPECT_EQ(measured_modes(record(BackwardMode::kSplit, costs({1, 1}, {1, 1}, {1, 1}, {2, 0}))),
            (std::vector<BackwardMode>{BackwardMode::kSplit}));
  EXPECT_EQ(measured_modes(record(BackwardMode::kStandard, costs({1}, {1}, {1}, {2}))),
            (std::vector<BackwardMode>{BackwardMode::kStandard, BackwardMode::kSplit}));
}

// The mode a record of measured costs is written under: the one whose costs cover every stage, 2BP first; none
// when neither does -- whatever the number of stages.
TEST(PartnerRule, ARecordTakesTheModeItsCostsCoverOnEveryStage) {
  for (std::size_t n : {1u, 3u}) {
    const std::vector<double> ones(n, 1.0), zeros(n, 0.0);
    std::vector<double> holed = ones;
    holed.back() = 0.0;
    EXPECT_EQ(measured_mode(costs(ones, ones, ones, zeros)), BackwardMode::kSplit);
    EXPECT_EQ(measured_mode(costs(ones, ones, ones, ones)), BackwardMode::kSplit);
    EXPECT_EQ(measured_mode(costs(ones, zeros, zeros, ones)), BackwardMode::kStandard);
    EXPECT_EQ(measured_mode(costs(ones, ones, holed, ones)), BackwardMode::kStandard);
    EXPECT_EQ(measured_mode(costs(ones, holed, ones, holed)), std::nullopt);
    EXPECT_EQ(measured_mode(costs(ones, {}, {}, {})), std::nullopt);
    // A record written under that mode lists both modes when it covers both.
    EXPECT_EQ(measured_modes(record(*measured_mode(costs(ones, ones, ones, ones)), costs(ones, ones, ones, ones))),
              (std::vector<BackwardMode>{BackwardMode::kSplit, BackwardMode::kStandard}));
  }
}

// Measured on 2 ranks, v = 1: stage s on rank s, F = 1, 3; I = 2, 4; W = 1, 1; B = 0.
TEST(CostsForPlacement, MapsMeasuredStagesOntoAnotherShape) {
  MeasuredCosts m = costs({1, 3}, {2, 4}, {1, 1}, {0, 0});
  m.overlap = 0.5;
  std::string rule;
  Schedule same;
  same.num_ranks = 2;
  same.num_stages = 2;
  same.stage_to_rank = {0, 1};
  CostModel c = costs_for_placement(m, {0, 1}, same, &rule);
  EXPECT_EQ(rule, "per-stage");
  EXPECT_EQ(c.forward, (std::vector<double>{1, 3}));
  EXPECT_DOUBLE_EQ(c.communication, 0.25);
  EXPECT_DOUBLE_EQ(c.overlap, 0.5);
  Schedule looped = same;  // v = 2 on the same ranks: each chunk half its rank's stage
  looped.num_stages = 4;
  looped.stage_to_rank = {0, 1, 1, 0};
  c = costs_for_placement(m, {0, 1}, looped, &rule);
  EXPECT_EQ(rule, "per-rank / v");
  EXPECT_EQ(c.forward, (std::vector<double>{0.5, 1.5, 1.5, 0.5}));
  EXPECT_EQ(c.backward_input, (std::vector<double>{1, 2, 2, 1}));
  Schedule wider;  // 4 ranks, v = 1: every chunk the mean rank's
  wider.num_ranks = 4;
  wider.num_stages = 4;
  wider.stage_to_rank = {0, 1, 2, 3};
  c = costs_for_placement(m, {0, 1}, wider, &rule);
  EXPECT_EQ(rule, "mean-rank / v");
  EXPECT_EQ(c.forward, (std::vector<double>(4, 2.0)));
  EXPECT_EQ(c.backward_weight, (std::vector<double>(4, 1.0)));
  EXPECT_TRUE(c.backward_weight_fixed.empty());
  EXPECT_THROW(costs_for_placement(m, {0, 1, 1}, same), UsageError);
}

}  // namespace
}  // namespace twobp
