// `twobp_bench check-schedules`: does every built-in schedule pair correctly on a transport?
//
//   twobp_bench check-schedules --transport nccl --json out.json
//
// For every built-in schedule x {standard, 2bp} x p in {2, 3, 4, 8} x m in {p, p + 1, 2p, 3p} (v = the
// schedule's default), it generates the schedule and validates it against the transport's pairing rule
// (twobp::pairing_of(transport)): for "nccl" and "local-in-order" that includes "on every channel the sender posts
// its messages in the order the receiver posts its receives". Output: {"transport", "pairing", "results":
// [{"schedule","mode","p","m","ok"[,"error"]}]} and a table; the exit status is 1 unless every case is ok.
// No model runs; no torch in this file.

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "twobp/error.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/validate.h"
#include "twobp/transport/pairing.h"
#include "twobp_cli.h"

namespace twobp::bench {
namespace {

struct CheckArgs {
  std::string transport = "nccl";
  std::vector<int> ranks{2, 3, 4, 8};
  std::string json;
};

int run_check(const CheckArgs& a) {
  const Pairing pairing = pairing_of(a.transport);
  Json results = Json::array();
  std::vector<std::vector<std::string>> rows{{"schedule", "mode", "p", "m", "pairs"}};
  int failed = 0;
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p : a.ranks) {
        for (int m : {p, p + 1, 2 * p, 3 * p}) {  // p + 1: a count that is no multiple of p
          const ScheduleOptions so = default_schedule_options(name, p, m, mode);
          Json r;
          r["schedule"] = name;
          r["mode"] = to_string(mode);
          r["p"] = p;
          r["m"] = m;
          try {
            validate(make_schedule_generator(name)->generate(so), pairing);
            r["ok"] = true;
          } catch (const ScheduleError& e) {
            r["ok"] = false;
            const std::string what = e.what();
            r["error"] = what.substr(0, what.find('\n'));  // the grid stays out of the file
            ++failed;
          }
          rows.push_back({name, r["mode"].get<std::string>(), std::to_string(p), std::to_string(m),
                          r["ok"].get<bool>() ? "ok" : "FAILS"});
          results.push_back(std::move(r));
        }
      }
    }
  }
  print_table(std::cout, rows);
  std::cout << fmt::format("{} of {} configurations pair correctly on transport '{}' (pairing {})\n",
                           results.size() - failed, results.size(), a.transport, to_string(pairing));
  if (!a.json.empty()) {
    Json out;
    out["transport"] = a.transport;
    out["pairing"] = to_string(pairing);
    out["results"] = std::move(results);
    cli::write_json(a.json, out);
    std::cout << "wrote " << a.json << "\n";
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace

void add_check_schedules_command(CLI::App& app) {
  auto args = std::make_shared<CheckArgs>();
  auto* cmd = app.add_subcommand("check-schedules",
                                 "check that every built-in schedule pairs its messages correctly on a transport");
  cmd->add_option("--transport", args->transport, "local | local-in-order | mpi | store | nccl")->capture_default_str();
  cmd->add_option("--ranks", args->ranks, "pipeline sizes p (m = p, p + 1, 2p, 3p each)")->capture_default_str()
      ->check(cli::number_in(1, 64));
  cmd->add_option("--json", args->json, "write the results here")->check(cli::writable_file());
  cmd->callback([args] {
    const int rc = run_check(*args);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace twobp::bench
