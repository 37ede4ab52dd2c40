// StoreTransport: see twobp/transport/store.h. Every store call goes through Impl::call, which turns c10d's
// exceptions into TransportError naming this rank and the operation.

#include "twobp/transport/store.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "transport/common.h"
#include "twobp/transport/status_board.h"
#include "util/check.h"

namespace twobp {
namespace {

// Wire format of a message or a collective contribution: [dtype, ndim, dims...] as int64, then the bytes.
std::vector<std::uint8_t> pack(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::vector<std::int64_t> header{static_cast<std::int64_t>(c.scalar_type()), c.dim()};
  for (auto d : c.sizes()) header.push_back(d);
  std::vector<std::uint8_t> out(header.size() * sizeof(std::int64_t) + c.nbytes());
  std::memcpy(out.data(), header.data(), header.size() * sizeof(std::int64_t));
  if (c.nbytes() > 0) std::memcpy(out.data() + header.size() * sizeof(std::int64_t), c.data_ptr(), c.nbytes());
  return out;
}

/// Shape and dtype of a packed value; `offset` is where the bytes begin. Returns false when malformed.
bool unpack_header(const std::vector<std::uint8_t>& v, c10::ScalarType* dtype, std::vector<std::int64_t>* sizes,
                   std::size_t* offset) {
  if (v.size() < 2 * sizeof(std::int64_t)) return false;
  std::int64_t head[2];
  std::memcpy(head, v.data(), sizeof(head));
  if (head[1] < 0 || head[1] > 64 || head[0] < 0 || head[0] >= static_cast<std::int64_t>(c10::ScalarType::NumOptions))
    return false;
  const std::size_t header = (2 + static_cast<std::size_t>(head[1])) * sizeof(std::int64_t);
  if (v.size() < header) return false;
  sizes->resize(static_cast<std::size_t>(head[1]));
  std::memcpy(sizes->data(), v.data() + 2 * sizeof(std::int64_t), sizes->size() * sizeof(std::int64_t));
  *dtype = static_cast<c10::ScalarType>(head[0]);
  *offset = header;
  return true;
}

// The store's status board. A rank whose wait timed out publishes its own status under
// "<prefix>/status/<incident>/<rank>" and asks the others ("<prefix>/status/ask" = incident). Each process
// answers from a thread of its own that looks for the question every 200 ms while a reader is attached (like
// c10d's heartbeat monitor), so a rank stuck in compute answers too; a dead one never does, and collect() leaves
// it nullopt. The cost while nothing stalls: one store lookup per rank every 200 ms.
class StoreStatusBoard final : public StatusBoard {
 public:
  StoreStatusBoard(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int world)
      : store_(std::move(store)), prefix_(std::move(prefix)), world_(world) {}

  ~StoreStatusBoard() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (watcher_.joinable()) watcher_.join();
  }

  void attach(int rank, Reader reader) override {
    std::lock_guard<std::mutex> lock(mutex_);
    rank_ = rank;
    reader_ = std::move(reader);
    if (!watcher_.joinable()) watcher_ = std::thread([this] { watch(); });
  }

  void detach(int rank) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (rank == rank_) reader_ = nullptr;
  }

  std::vector<std::optional<std::string>> collect(int rank, std::int64_t incident, Duration wait) override {
    std::vector<std::optional<std::string>> out(static_cast<std::size_t>(world_));
    try {
      answer(incident);
      const std::string ask = std::to_string(incident);
      store_->set(ask_key(), std::vector<std::uint8_t>(ask.begin(), ask.end()));
      const auto deadline = Clock::now() + wait;
      for (;;) {
        bool all = true;
        for (int r = 0; r < world_; ++r) {
          auto& slot = out[static_cast<std::size_t>(r)];
          if (slot) continue;
          const std::string k = status_key(incident, r);
          if (store_->check({k})) {
            const auto v = store_->get(k);
            slot = std::string(v.begin(), v.end());
          } else {
            all = false;
          }
        }
        if (all || Clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception&) {
      // The store is gone (rank 0 died): report what was gathered; the others count as not answering.
    }
    (void)rank;
    return out;
  }

  std::string agree_on_report(std::int64_t incident, const std::string& report) override {
    try {
      // compareSet with an empty expected value sets only a missing key, and returns what the key then holds.
      const auto v = store_->compareSet(fmt::format("{}/status/{}/report", prefix_, incident), {},
                                        std::vector<std::uint8_t>(report.begin(), report.end()));
      return std::string(v.begin(), v.end());
    } catch (const std::exception&) {
      return report;  // the store is gone: this rank's own report
    }
  }

 private:
  std::string ask_key() const { return prefix_ + "/status/ask"; }
  std::string status_key(std::int64_t incident, int rank) const {
    return fmt::format("{}/status/{}/{}", prefix_, incident, rank);
  }

  // Publishes this rank's status for `incident` (once).
  void answer(std::int64_t incident) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!reader_ || incident == answered_) return;
    const std::string status = reader_();
    store_->set(status_key(incident, rank_), std::vector<std::uint8_t>(status.begin(), status.end()));
    answered_ = incident;
  }

  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stop_; })) {
      lock.unlock();
      try {
        if (store_->check({ask_key()})) {
          const auto v = store_->get(ask_key());
          answer(std::stoll(std::string(v.begin(), v.end())));
        }
      } catch (const std::exception&) {
        // The store is gone or the question unreadable: nothing to answer; the job ends through its own errors.
      }
      lock.lock();
    }
  }

  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string prefix_;
  const int world_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread watcher_;
  int rank_ = -1;
  Reader reader_;
  std::int64_t answered_ = -1;
};

}  // namespace

struct StoreTransport::Impl {
  int rank = 0;
  int world = 1;
  std::string prefix;
  c10::intrusive_ptr<c10d::Store> store;
  std::map<std::pair<int, std::int64_t>, std::int64_t> sent;      // (dst, tag) -> messages sent
  std::map<std::pair<int, std::int64_t>, std::int64_t> received;  // (src, tag) -> receives posted
  std::int64_t collectives = 0;                                   // sequence shared by all_reduce_sum and barrier
  std::string broken;  // non-empty once a collective timed out: later ones throw it
  std::int64_t splits = 0;  // split() calls so far: with the color, names a group's key prefix
  std::string name;         // empty: "rank <rank>"; in a group: "rank 1 (group color 0, rank 2 in the parent)"
  bool is_group = false;    // a group shares its parent's store and does not serve it
  std::shared_ptr<StoreStatusBoard> board;  // under prefix: a group's never meets its parent's

  std::string who() const { return name.empty() ? fmt::format("rank {}", rank) : name; }

  std::string key(const std::string& suffix) const { return prefix + "/" + suffix; }
  std::string abort_key() const { return key("abort"); }

  template <typename F>
  auto call(const std::string& what, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const c10::Error& e) {
      detail::raise<TransportError>("{}: {}: the store (served by rank 0) failed: {}", who(), what,
                                    e.what_without_backtrace());
    }
  }

  /// Throws TransportError when some rank aborted.
  void check_abort(const std::string& what) {
    if (!call(what, [&] { return store->check({abort_key()}); })) return;
    const auto v = call(what, [&] { return store->get(abort_key()); });
    detail::raise<TransportError>("{}: {} failed: {}", who(), what, std::string(v.begin(), v.end()));
  }

  /// Polls until `k` exists (true), the deadline passes (false) or a rank aborted (throws). The abort key is
  /// looked at on every poll, so an abort is seen within one back-off step.
  bool poll_for(const std::string& k, Clock::time_point deadline, const std::string& what) {
    detail::Backoff backoff(std::chrono::microseconds(2000));
    for (;;) {
      if (call(what, [&] { return store->check({k}); })) return true;
      check_abort(what);
      if (Clock::now() >= deadline) return false;
      backoff.pause();
    }
  }

  /// root < 0: sum (all_reduce_sum) or nothing (barrier: tensor null); else every rank gets root's tensor.
  void collective(const std::string& kind, at::Tensor* tensor, Duration timeout, int root = -1);

  /// One collective's values, all under coll/<g>/: rank r's for every rank at coll/<g>/<r>, its value for rank d
  /// alone (reduce_scatter_sum's shards) at coll/<g>/<r>/<d>. A value is the collective's kind, the signature every
  /// rank must pass alike ("input [10] Float"), then a tensor (pack()).
  std::string coll_key(std::int64_t g, int from, int to = -1) const {
    return key(to < 0 ? fmt::format("coll/{}/{}", g, from) : fmt::format("coll/{}/{}/{}", g, from, to));
  }
  void contribute(std::int64_t g, int to, const std::string& kind, const std::string& signature, const at::Tensor& t,
                  const std::string& what);
  /// Rank `from`'s value of collective g for `to` (-1: for every rank), once it is there: polls until the
  /// deadline (TimeoutError naming the ranks whose values are missing, and the collective is broken for later
  /// calls), then checks its kind and signature against ours (UsageError naming both ranks). The tensor.
  at::Tensor take(std::int64_t g, int from, int to, const std::string& kind, const std::string& signature,
                  Clock::time_point deadline, Duration timeout, const std::string& what);
  /// The last of the `world` readers of collective g's values for every rank deletes them.
  void release(std::int64_t g, const std::string& what);
  /// Starts collective number `collectives` ("<kind> #<g>"): refused once one timed out, or after an abort.
  std::int64_t begin(const std::string& kind, std::string* what);
};

namespace {

class StoreSendWork final : public Work {
 public:
  void wait(Duration) override {}
  bool is_completed() override { return true; }
};

class StoreRecvWork final : public Work {
 public:
  StoreRecvWork(std::shared_ptr<StoreTransport::Impl> impl, std::string key, at::Tensor buffer, P2POptions options)
      : impl_(std::move(impl)), key_(std::move(key)), buffer_(std::move(buffer)), options_(std::move(options)) {}

  void wait(Duration timeout) override {
    if (finished_) return;
    if (!impl_->poll_for(key_, detail::deadline_after(timeout), what())) {
      detail::raise<TimeoutError>("{}: timed out after {} ms waiting for {}", impl_->who(), timeout.count(),
                                  what());
    }
    finish();
  }

  bool is_completed() override {
    if (finished_) return true;
    if (!impl_->call(what(), [&] { return impl_->store->check({key_}); })) {
      impl_->check_abort(what());
      return false;
    }
    finish();
    return true;
  }

 private:
  std::string what() const { return fmt::format("{} from rank {}", detail::describe_op(options_), options_.peer); }

  void finish() {
    finished_ = true;
    const auto v = impl_->call(what(), [&] { return impl_->store->get(key_); });
    impl_->call(what(), [&] { return impl_->store->deleteKey(key_); });
    c10::ScalarType dtype;
    std::vector<std::int64_t> sizes;
    std::size_t offset = 0;
    TWOBP_CHECK(unpack_header(v, &dtype, &sizes, &offset), TransportError, "{}: {}: malformed message",
                impl_->who(), what());
    TWOBP_CHECK(at::IntArrayRef(sizes) == buffer_.sizes() && dtype == buffer_.scalar_type(), UsageError,
                "{}: {}: expected {} but rank {} sent {}", impl_->who(), what(), detail::describe_tensor(buffer_),
                options_.peer, detail::describe_tensor(sizes, dtype));
    TWOBP_CHECK(v.size() - offset == buffer_.nbytes(), TransportError, "{}: {}: message has {} bytes, expected {}",
                impl_->who(), what(), v.size() - offset, buffer_.nbytes());
    if (buffer_.nbytes() > 0) std::memcpy(buffer_.data_ptr(), v.data() + offset, buffer_.nbytes());
  }

  std::shared_ptr<StoreTransport::Impl> impl_;
  std::string key_;
  at::Tensor buffer_;
  P2POptions options_;
  bool finished_ = false;
};

}  // namespace

StoreTransport::StoreTransport(const LaunchEnv& env, StoreOptions options) : impl_(std::make_shared<Impl>()) {
  auto& im = *impl_;
  im.rank = env.rank;
  im.world = env.world_size;
  im.prefix = options.prefix;
  TWOBP_CHECK(!env.master_addr.empty() && env.master_port > 0, UsageError,
              "rank {}: StoreTransport: no rendezvous address: set MASTER_ADDR and MASTER_PORT (the host of rank 0 "
              "and a free TCP port; torchrun sets both)",
              env.rank);
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(env.master_port);
  o.isServer = env.rank == 0 && !env.agent_store;  // under torchrun the agent's store is already there
  o.numWorkers = static_cast<std::size_t>(env.world_size);
  o.waitWorkers = false;  // the barrier below waits, with our timeout and error message
  o.timeout = options.connect_timeout;
  try {
    im.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
  } catch (const c10::Error& e) {
    detail::raise<TransportError>("rank {}: StoreTransport: cannot {} the TCPStore at {}:{} within {} ms: {}",
                                  env.rank, env.rank == 0 ? "serve" : "reach", env.master_addr, env.master_port,
                                  options.connect_timeout.count(), e.what_without_backtrace());
  }
  im.board = std::make_shared<StoreStatusBoard>(im.store, im.prefix, im.world);
  barrier(options.connect_timeout);
}

StoreTransport::~StoreTransport() {
  // Rank 0's process serves the store: it must outlive the other ranks' last reads. Every rank checks out; rank 0
  // waits (bounded: a crashed rank never checks out) until all did -- for at most 10 s, and at most 5 s once some
  // rank aborted: the others still read the abort, and agree on a hang report, through the store.
  auto& im = *impl_;
  if (im.is_group) return;  // the parent's destructor keeps the store alive for everyone
  try {
    im.store->add(im.key("checked_out"), 1);
    if (im.rank != 0) return;
    auto deadline = Clock::now() + Duration(10000);
    bool aborted = false;
    detail::Backoff backoff(std::chrono::microseconds(2000));
    while (im.store->add(im.key("checked_out"), 0) < im.world && Clock::now() < deadline) {
      if (!aborted && im.store->check({im.abort_key()})) {
        aborted = true;
        deadline = std::min(deadline, Clock::now() + Duration(5000));
      }
      backoff.pause();
    }
  } catch (const std::exception&) {
    // Destructors do not throw; a broken store has nobody left to wait for.
  }
}

int StoreTransport::rank() const { return impl_->rank; }
int StoreTransport::world_size() const { return impl_->world; }

std::unique_ptr<Work> StoreTransport::isend(const at::Tensor& tensor, const P2POptions& options) {
  auto& im = *impl_;
  detail::check_p2p_args("isend", im.rank, im.world, tensor, options);
  TWOBP_CHECK(tensor.is_cpu(), UsageError, "{}: isend {}: StoreTransport moves CPU tensors, got one on {}",
              im.who(), detail::describe_op(options), tensor.device().str());
  const std::string what = fmt::format("{} to rank {}", detail::describe_op(options), options.peer);
  im.check_abort(what);
  const std::int64_t n = im.sent[{options.peer, options.tag}]++;
  const std::string k = im.key(fmt::format("p2p/{}/{}/{}/{}", im.rank, options.peer, options.tag, n));
  const auto value = pack(tensor);
  im.call(what, [&] {
    im.store->set(k, value);
    return 0;
  });
  return std::make_unique<StoreSendWork>();
}

std::unique_ptr<Work> StoreTransport::irecv(at::Tensor& buffer, const P2POptions& options) {
  auto& im = *impl_;
  detail::check_p2p_args("irecv", im.rank, im.world, buffer, options);
  TWOBP_CHECK(buffer.is_cpu(), UsageError, "{}: irecv {}: StoreTransport moves CPU tensors, got one on {}",
              im.who(), detail::describe_op(options), buffer.device().str());
  const std::int64_t n = im.received[{options.peer, options.tag}]++;
  const std::string k = im.key(fmt::format("p2p/{}/{}/{}/{}", options.peer, im.rank, options.tag, n));
  return std::make_unique<StoreRecvWork>(impl_, k, buffer, options);
}

std::int64_t StoreTransport::Impl::begin(const std::string& kind, std::string* what) {
  const std::int64_t g = collectives++;
  *what = fmt::format("{} #{}", kind, g);
  TWOBP_CHECK(broken.empty(), TransportError, "{}: {} failed: {}", who(), *what, broken);
  check_abort(*what);
  return g;
}

void StoreTransport::Impl::contribute(std::int64_t g, int to, const std::string& kind, const std::string& signature,
                                      const at::Tensor& t, const std::string& what) {
  auto value = pack(t);
  std::string head = kind;
  head.push_back('\0');
  head += signature;
  head.push_back('\0');
  value.insert(value.begin(), head.begin(), head.end());
  call(what, [&] {
    store->set(coll_key(g, rank, to), value);
    return 0;
  });
}

at::Tensor StoreTransport::Impl::take(std::int64_t g, int from, int to, const std::string& kind,
                                      const std::string& signature, Clock::time_point deadline, Duration timeout,
                                      const std::string& what) {
  const std::string k = coll_key(g, from, to);
  if (!poll_for(k, deadline, what)) {
    std::string missing;
    for (int q = from; q < world; ++q) {
      if (!call(what, [&] { return store->check({coll_key(g, q, to)}); })) {
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", q);
      }
    }
    broken = fmt::format("{}: timed out after {} ms in {} waiting for rank(s) {}", who(), timeout.count(), what,
                         missing);
    throw TimeoutError(broken);
  }
  auto v = call(what, [&] { return store->get(k); });
  // The kind, then the signature, each ended by a 0 byte.
  const auto kind_end = std::find(v.begin(), v.end(), std::uint8_t{0});
  const auto sig_end = kind_end == v.end() ? v.end() : std::find(kind_end + 1, v.end(), std::uint8_t{0});
  TWOBP_CHECK(sig_end != v.end(), TransportError, "{}: {}: malformed contribution of rank {}", who(), what, from);
  const std::string other_kind(v.begin(), kind_end), other_signature(kind_end + 1, sig_end);
  TWOBP_CHECK(other_kind == kind, UsageError,
              "{} called {} while rank {} called {} (collective #{}): every rank must call the collectives in "
              "the same order",
              who(), kind, from, other_kind, g);
  TWOBP_CHECK(other_signature == signature, UsageError, "{}: {}: {} does not match rank {}'s {}", who(), what,
              signature, from, other_signature);
  v.erase(v.begin(), sig_end + 1);
  c10::ScalarType dtype;
  std::vector<std::int64_t> sizes;
  std::size_t offset = 0;
  TWOBP_CHECK(unpack_header(v, &dtype, &sizes, &offset), TransportError, "{}: {}: malformed contribution of rank {}",
              who(), what, from);
  at::Tensor part = at::empty(sizes, at::TensorOptions().dtype(dtype));
  TWOBP_CHECK(v.size() - offset == part.nbytes(), TransportError, "{}: {}: rank {}'s contribution has {} bytes, "
              "expected {}", who(), what, from, v.size() - offset, part.nbytes());
  if (part.nbytes() > 0) std::memcpy(part.data_ptr(), v.data() + offset, part.nbytes());
  return part;
}

void StoreTransport::Impl::release(std::int64_t g, const std::string& what) {
  if (call(what, [&] { return store->add(key(fmt::format("coll/{}/done", g)), 1); }) != world) return;
  for (int r = 0; r < world; ++r) call(what, [&] { return store->deleteKey(coll_key(g, r)); });
  call(what, [&] { return store->deleteKey(key(fmt::format("coll/{}/done", g))); });
}

void StoreTransport::Impl::collective(const std::string& kind, at::Tensor* tensor, Duration timeout, int root) {
  const auto deadline = detail::deadline_after(timeout);
  std::string what;
  const std::int64_t g = begin(kind, &what);
  // Every rank's value names the kind and its tensor's shape and dtype, so a rank calling barrier while another
  // sums, or passing another shape, is a clear UsageError. A broadcast's non-roots send no data.
  const bool contributes = tensor && (root < 0 || root == rank);
  const std::string signature =
      tensor ? fmt::format("tensor {}", detail::describe_tensor(*tensor)) : std::string();
  contribute(g, -1, kind, signature, contributes ? tensor->contiguous() : at::empty({0}, at::kByte), what);
  at::Tensor sum;
  for (int r = 0; r < world; ++r) {
    at::Tensor part = take(g, r, -1, kind, signature, deadline, timeout, what);
    if (!tensor || (root >= 0 && r != root)) continue;
    sum = (root >= 0 || r == 0) ? part : sum.add_(part);  // rank order: bitwise reproducible
  }
  release(g, what);
  if (tensor) tensor->copy_(sum);
}

void StoreTransport::all_reduce_sum(at::Tensor& tensor, Duration timeout) {
  TWOBP_CHECK(tensor.defined() && tensor.is_cpu(), UsageError,
              "{}: all_reduce_sum needs a defined CPU tensor", impl_->who());
  impl_->collective("all_reduce_sum", &tensor, timeout);
}

void StoreTransport::barrier(Duration timeout) { impl_->collective("barrier", nullptr, timeout); }

void StoreTransport::reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) {
  auto& im = *impl_;
  detail::check_reduce_scatter_args(im.who(), im.world, im.rank, input, output);
  TWOBP_CHECK(input.is_cpu(), UsageError, "{}: reduce_scatter_sum: StoreTransport reduces CPU tensors, got one on {}",
              im.who(), input.device().str());
  const auto deadline = detail::deadline_after(timeout);
  const std::string kind = "reduce_scatter_sum";
  std::string what;
  const std::int64_t g = im.begin(kind, &what);
  const std::string signature = fmt::format("input {}", detail::describe_tensor(input));
  // Each rank's shard d goes to rank d alone (a value of its own), so every rank reads n elements, not world * n.
  for (int d = 0; d < im.world; ++d) {
    const ShardRange range = shard_range(input.numel(), im.world, d);
    im.contribute(g, d, kind, signature, input.narrow(0, range.begin, range.size()), what);
  }
  at::Tensor sum;
  for (int r = 0; r < im.world; ++r) {
    at::Tensor part = im.take(g, r, im.rank, kind, signature, deadline, timeout, what);
    sum = r == 0 ? part : sum.add_(part);  // rank order, as all_reduce_sum: the same bits
    // This rank is the value's only reader.
    im.call(what, [&] { return im.store->deleteKey(im.coll_key(g, r, im.rank)); });
  }
  output.copy_(sum);
}

void StoreTransport::all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  auto& im = *impl_;
  detail::check_all_gather_args(im.who(), im.world, im.rank, shard, output);
  TWOBP_CHECK(shard.is_cpu(), UsageError, "{}: all_gather: StoreTransport gathers CPU tensors, got one on {}",
              im.who(), shard.device().str());
  const auto deadline = detail::deadline_after(timeout);
  const std::string kind = "all_gather";
  std::string what;
  const std::int64_t g = im.begin(kind, &what);
  // The signature is the output's: the shards differ in size by design, the outputs must not.
  const std::string signature = fmt::format("output {}", detail::describe_tensor(output));
  im.contribute(g, -1, kind, signature, shard, what);
  for (int r = 0; r < im.world; ++r) {
    const ShardRange range = shard_range(output.numel(), im.world, r);
    at::Tensor part = im.take(g, r, -1, kind, signature, deadline, timeout, what);
    TWOBP_CHECK(part.numel() == range.size(), TransportError, "{}: {}: rank {} sent {} elements for its shard [{}, {})",
                im.who(), what, r, part.numel(), range.begin, range.end);
    output.narrow(0, range.begin, range.size()).copy_(part);
  }
  im.release(g, what);
}

void StoreTransport::broadcast(at::Tensor& tensor, int root, Duration timeout) {
  auto& im = *impl_;
  TWOBP_CHECK(tensor.defined() && tensor.is_cpu(), UsageError, "{}: broadcast needs a defined CPU tensor", im.who());
  TWOBP_CHECK(root >= 0 && root < im.world, UsageError, "{}: broadcast from root {}: no such rank (world size {})",
              im.who(), root, im.world);
  // The root is part of the kind: ranks disagreeing about it get the "same order" UsageError.
  im.collective(fmt::format("broadcast from rank {}", root), &tensor, timeout, root);
}

StoreTransport::StoreTransport(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Transport> StoreTransport::split(int color, int key, Duration timeout) {
  auto& im = *impl_;
  const std::int64_t number = im.splits++;
  const auto colors = detail::gather_split_colors(*this, color, key, timeout);
  if (color < 0) return nullptr;
  const std::vector<int> members = detail::split_members(colors, color);
  auto child = std::make_shared<Impl>();
  child->rank = static_cast<int>(std::find(members.begin(), members.end(), im.rank) - members.begin());
  child->world = static_cast<int>(members.size());
  // Same store, own key space: a group's messages, collectives and abort key never meet another group's.
  child->prefix = im.key(fmt::format("split{}/color{}", number, color));
  child->store = im.store;
  child->name = detail::group_member_name(child->rank, color, im.who());
  child->is_group = true;
  child->board = std::make_shared<StoreStatusBoard>(child->store, child->prefix, child->world);
  return std::unique_ptr<Transport>(new StoreTransport(std::move(child)));
}

std::shared_ptr<StatusBoard> StoreTransport::status_board() const { return impl_->board; }

void StoreTransport::abort(const std::string& reason) {
  auto& im = *impl_;
  // compareSet keeps the first abort's reason: that is what every rank reports.
  const std::string v = fmt::format("{} aborted: {}", im.who(), reason);
  try {
    im.store->compareSet(im.abort_key(), {}, std::vector<std::uint8_t>(v.begin(), v.end()));
  } catch (const std::exception&) {
    // The store is gone (rank 0 died): the peers find out through their own store errors.
  }
}

}  // namespace twobp
