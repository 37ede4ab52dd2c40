// The in-process status board: ranks are threads of one process, so a stall's report reads every rank's status
// directly -- a rank stuck in compute is seen as such, without its thread having to answer.

#include "twobp/transport/status_board.h"

#include <map>
#include <mutex>

#include "util/check.h"

namespace twobp {
namespace {

class InProcessStatusBoard final : public StatusBoard {
 public:
  explicit InProcessStatusBoard(int world) : world_(world) {}

  void attach(int rank, Reader reader) override {
    TWOBP_CHECK(rank >= 0 && rank < world_, UsageError, "status board: rank {} is outside the group of {}", rank,
                world_);
    std::lock_guard<std::mutex> lock(mutex_);
    readers_[rank] = std::move(reader);
  }

  void detach(int rank) override {
    std::lock_guard<std::mutex> lock(mutex_);
    readers_.erase(rank);
  }

  // Readers run under the mutex, so detach() returning means its reader is no longer running or called.
  std::vector<std::optional<std::string>> collect(int, std::int64_t, Duration) override {
    std::vector<std::optional<std::string>> out(static_cast<std::size_t>(world_));
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [rank, reader] : readers_) out[static_cast<std::size_t>(rank)] = reader();
    return out;
  }

  std::string agree_on_report(std::int64_t incident, const std::string& report) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return reports_.try_emplace(incident, report).first->second;
  }

 private:
  const int world_;
  std::mutex mutex_;
  std::map<int, Reader> readers_;
  std::map<std::int64_t, std::string> reports_;
};

}  // namespace

std::shared_ptr<StatusBoard> make_in_process_status_board(int world_size) {
  return std::make_shared<InProcessStatusBoard>(world_size);
}

}  // namespace twobp
