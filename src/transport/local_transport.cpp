// LocalTransport: ranks are threads of one process sharing a mailbox. See twobp/transport/local.h for the
// semantics; this file keeps every piece of shared state under LocalGroupState::mutex.

#include "twobp/transport/local.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <algorithm>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "transport/common.h"
#include "twobp/transport/status_board.h"
#include "util/check.h"

namespace twobp {
namespace detail {

namespace {

/// Set by whichever side matches a message with a receive; read by the sender's Work.
struct SendState {
  bool matched = false;
};

/// A posted receive; `payload` is filled in (and `matched` set) when the message arrives, together with the
/// sender's tag and label (compared with the receive's own under in-order pairing).
struct RecvState {
  bool matched = false;
  at::Tensor payload;
  std::shared_ptr<c10::Event> written;  // device payloads: recorded on the sender's stream after the clone
  std::int64_t tag = 0;
  std::string label;
};

struct Message {
  at::Tensor payload;
  std::shared_ptr<SendState> send;
  std::shared_ptr<c10::Event> written;
  std::int64_t tag = 0;
  std::string label;
};

/// (src, dst, tag) under by-tag pairing, (src, dst, channel) under in-order pairing.
struct MailKey {
  int src;
  int dst;
  std::int64_t tag;
  bool operator<(const MailKey& o) const { return std::tie(src, dst, tag) < std::tie(o.src, o.dst, o.tag); }
};

/// At most one of the two queues is non-empty: a new message first satisfies a posted receive and a new
/// receive first takes a queued message, both in FIFO order (the non-overtaking rule MPI has too).
struct Mailbox {
  std::deque<Message> messages;
  std::deque<std::shared_ptr<RecvState>> receives;
  bool empty() const { return messages.empty() && receives.empty(); }
};

}  // namespace

struct LocalGroupState;

/// Every group split (transitively) from one LocalTransportGroup: an abort anywhere reaches all of them, as an
/// MPI abort ends the whole job, so that a rank failing in one group does not leave its peers in another group
/// (a data-parallel group next to a pipeline group) waiting for their timeouts.
///
/// WHY the abort lives here, not in each group: a group created after an abort (a split racing with it) must see
/// it too. abort() sets the flag first, then wakes every member it knows of under that member's mutex; a member
/// created later checks the flag before it ever waits.
struct LocalFamily {
  std::mutex mutex;  // guards members and the first abort's who/reason
  std::vector<std::weak_ptr<LocalGroupState>> members;
  std::atomic<bool> aborted{false};
  std::string abort_who;  // "rank 2", or "rank 0 (group color 1, rank 2 in the parent)"
  std::string abort_reason;
  int ranks = 0;  // of the LocalTransportGroup the family started from: the rank threads of this process
  std::vector<c10::Device> devices;  // of those ranks, by rank (from its LocalOptions::devices)
};

struct LocalGroupState {
  LocalGroupState(int world_size, LocalOptions opts, std::vector<std::string> member_names = {},
                  std::shared_ptr<LocalFamily> fam = nullptr)
      : world(world_size), options(std::move(opts)), names(default_names(world_size, std::move(member_names))),
        wakeup(world_size), family(fam ? std::move(fam) : std::make_shared<LocalFamily>()) {
    if (family->ranks == 0) {
      family->ranks = world_size;
      for (int r = 0; r < world_size; ++r) {
        const auto& d = options.devices;
        family->devices.push_back(d.empty() ? c10::Device(c10::kCPU) : d.size() == 1 ? d.front() : d[r]);
      }
    }
  }

  static std::vector<std::string> default_names(int world, std::vector<std::string> names) {
    if (names.empty()) {
      for (int r = 0; r < world; ++r) names.push_back(fmt::format("rank {}", r));
    }
    return names;
  }

  const int world;
  const LocalOptions options;
  /// How rank r names itself in errors: "rank 2", or in a group "rank 1 (group color 0, rank 2 in the parent)".
  const std::vector<std::string> names;
  const std::string& who(int r) const { return names[static_cast<std::size_t>(r)]; }

  std::mutex mutex;
  /// wakeup[r] is waited on only by rank r's thread; whoever changes something rank r may wait for (a match
  /// of its send or receive, a finished collective, an abort) notifies it.
  std::vector<std::condition_variable> wakeup;

  std::map<MailKey, Mailbox> mail;

  /// The mailbox key of an operation between src and dst: what the pairing rule matches on.
  MailKey key(int src, int dst, const P2POptions& o) const {
    return MailKey{src, dst, options.pairing == Pairing::kByTag ? o.tag : static_cast<std::int64_t>(o.channel)};
  }

  const std::shared_ptr<LocalFamily> family;
  const std::shared_ptr<StatusBoard> board = make_in_process_status_board(world);

  bool aborted() const { return family->aborted.load(); }

  // Collectives: one sequence shared by all of them (all_reduce_sum, barrier, broadcast, reduce_scatter_sum,
  // all_gather). `generation` counts completed ones.
  std::int64_t generation = 0;
  int arrived = 0;
  std::string kind;  // of the collective being assembled
  std::vector<at::Tensor> contributions;
  std::vector<std::string> signatures;  // what each rank passed ("tensor [3] Float"): must be equal
  std::vector<bool> has_arrived;
  at::Tensor last_result;  // of generation-1; stays valid until every rank copied it (see collective())
  std::string failure;     // non-empty once a collective failed: all later collectives throw it

  /// Groups being handed out by split(): (split number, color) -> the group's state and how many of its members
  /// have not taken it yet. The first member to get there (after the gathering collective, so every member is
  /// known to be in split) creates it; the last one removes the entry.
  struct PendingGroup {
    std::shared_ptr<LocalGroupState> state;
    int untaken = 0;
  };
  std::map<std::pair<std::int64_t, int>, PendingGroup> splits;

  void notify_all_ranks() {
    for (auto& cv : wakeup) cv.notify_all();
  }

  /// Throws the error every wait raises after an abort. Caller holds `mutex`.
  [[noreturn]] void raise_aborted(int me, const std::string& what) const {
    raise<TransportError>("{}: {} failed: {} aborted: {}", who(me), what, family->abort_who, family->abort_reason);
  }
};

namespace {

class LocalSendWork final : public Work {
 public:
  LocalSendWork(std::shared_ptr<LocalGroupState> state, int rank, P2POptions options,
                std::shared_ptr<SendState> send)
      : state_(std::move(state)), rank_(rank), options_(std::move(options)), send_(std::move(send)) {}

  void wait(Duration timeout) override {
    const auto deadline = deadline_after(timeout);
    std::unique_lock<std::mutex> lock(state_->mutex);
    // Eager sends are complete once deposited; synchronous ones wait until the receiver posted its irecv.
    const bool done = state_->wakeup[rank_].wait_until(lock, deadline, [&] {
      return state_->aborted() || !state_->options.synchronous_sends || send_->matched;
    });
    if (state_->aborted()) state_->raise_aborted(rank_, what());
    if (!done) {
      raise<TimeoutError>("{}: timed out after {} ms waiting for {} to rank {} (rank {} has not posted the "
                          "matching receive)",
                          state_->who(rank_), timeout.count(), describe_op(options_), options_.peer, options_.peer);
    }
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->aborted()) state_->raise_aborted(rank_, what());
    return !state_->options.synchronous_sends || send_->matched;
  }

 private:
  std::string what() const { return fmt::format("{} to rank {}", describe_op(options_), options_.peer); }

  std::shared_ptr<LocalGroupState> state_;
  int rank_;
  P2POptions options_;
  std::shared_ptr<SendState> send_;
};

class LocalRecvWork final : public Work {
 public:
  LocalRecvWork(std::shared_ptr<LocalGroupState> state, int rank, P2POptions options, at::Tensor buffer,
                std::shared_ptr<RecvState> recv)
      : state_(std::move(state)),
        rank_(rank),
        options_(std::move(options)),
        buffer_(std::move(buffer)),
        recv_(std::move(recv)) {}

  ~LocalRecvWork() override {
    if (finished_) return;
    // Withdraw a receive that was never matched, so that a later message with the same key is not swallowed
    // by a receive nobody waits for.
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (recv_->matched) return;
    auto it = state_->mail.find(state_->key(options_.peer, rank_, options_));
    if (it == state_->mail.end()) return;
    auto& receives = it->second.receives;
    for (auto r = receives.begin(); r != receives.end(); ++r) {
      if (*r == recv_) {
        receives.erase(r);
        break;
      }
    }
    if (it->second.empty()) state_->mail.erase(it);
  }

  void wait(Duration timeout) override {
    if (finished_) return;
    const auto deadline = deadline_after(timeout);
    at::Tensor payload;
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      const bool matched = state_->wakeup[rank_].wait_until(
          lock, deadline, [&] { return state_->aborted() || recv_->matched; });
      if (state_->aborted()) state_->raise_aborted(rank_, what());
      if (!matched) {
        raise<TimeoutError>("{}: timed out after {} ms waiting for {} from rank {}", state_->who(rank_), timeout.count(),
                            describe_op(options_), options_.peer);
      }
      payload = std::move(recv_->payload);
    }
    finish(payload);
  }

  bool is_completed() override {
    if (finished_) return true;
    at::Tensor payload;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (state_->aborted()) state_->raise_aborted(rank_, what());
      if (!recv_->matched) return false;
      payload = std::move(recv_->payload);
    }
    finish(payload);
    return true;
  }

 private:
  std::string what() const { return fmt::format("{} from rank {}", describe_op(options_), options_.peer); }

  /// Copies the matched message into the buffer, outside the lock: the payload is owned by this Work now.
  void finish(const at::Tensor& payload) {
    finished_ = true;
    const std::shared_ptr<c10::Event> written = std::move(recv_->written);
    // Only possible under in-order pairing: the sender posted this channel's messages in another order (or one of
    // them was lost or delivered twice: tests/transport/fault_injection_test.cpp). NCCL
    // would deliver the tensor anyway; here it is an error naming both operations.
    TWOBP_CHECK(recv_->tag == options_.tag, UsageError,
                "{}: {} from rank {}: in-order pairing on channel {} matched it with rank {}'s {} (tag {}, "
                "expected tag {}): the two ranks post this channel's messages in different orders (or a message was "
                "lost or duplicated)",
                state_->who(rank_), describe_op(options_), options_.peer, options_.channel, options_.peer, recv_->label,
                recv_->tag, options_.tag);
    TWOBP_CHECK(payload.sizes() == buffer_.sizes() && payload.scalar_type() == buffer_.scalar_type(), UsageError,
                "{}: {} from rank {}: expected {} but rank {} sent {}", state_->who(rank_), describe_op(options_),
                options_.peer, describe_tensor(buffer_), options_.peer, describe_tensor(payload));
    if (written) {
      // SYNC POINT: the payload was cloned on the sender's stream; this rank's current stream reads it.
      const auto* impl = c10::impl::getDeviceGuardImpl(payload.device().type());
      const c10::Stream stream = impl->getStream(payload.device());
      written->block(stream);
      buffer_.copy_(payload);
      // The payload dies with this Work; its memory must not be reused before this stream's copy ran.
      impl->recordDataPtrOnStream(payload.storage().data_ptr(), stream);
    } else {
      buffer_.copy_(payload);
    }
  }

  std::shared_ptr<LocalGroupState> state_;
  int rank_;
  P2POptions options_;
  at::Tensor buffer_;  // shares storage with the caller's tensor
  std::shared_ptr<RecvState> recv_;
  bool finished_ = false;  // touched only by the owning thread
};

}  // namespace
}  // namespace detail

LocalTransport::LocalTransport(std::shared_ptr<detail::LocalGroupState> state, int rank)
    : state_(std::move(state)), rank_(rank) {}

LocalTransport::~LocalTransport() = default;

int LocalTransport::world_size() const { return state_->world; }

bool LocalTransport::ranks_share_process() const { return state_->family->ranks > 1; }

std::shared_ptr<StatusBoard> LocalTransport::status_board() const { return state_->board; }

int LocalTransport::ranks_sharing_device() const {
  const auto& all = state_->family->devices;
  return std::max<int>(1, static_cast<int>(std::count(all.begin(), all.end(), device())));
}

c10::Device LocalTransport::device() const {
  const auto& devices = state_->options.devices;
  if (devices.empty()) return c10::Device(c10::kCPU);
  return devices.size() == 1 ? devices.front() : devices[static_cast<std::size_t>(rank_)];
}

std::string LocalTransport::name() const {
  return state_->options.pairing == Pairing::kByTag ? "local" : "local-in-order";
}

Pairing LocalTransport::pairing() const { return pairing_of(name()); }

std::unique_ptr<Work> LocalTransport::isend(const at::Tensor& tensor, const P2POptions& options) {
  detail::check_p2p_args("isend", rank_, state_->world, tensor, options);
  // WHY clone: the mailbox owns an immutable snapshot, so the sender may reuse its buffer after wait() (in
  // fact as soon as isend returned) and the receiver never races with the sender's next write.
  at::Tensor payload = tensor.clone(at::MemoryFormat::Contiguous);
  std::shared_ptr<c10::Event> written;
  if (!payload.is_cpu()) {
    written = std::make_shared<c10::Event>(payload.device().type());
    written->record(c10::impl::getDeviceGuardImpl(payload.device().type())->getStream(payload.device()));
  }
  auto send = std::make_shared<detail::SendState>();
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->aborted()) {
      state_->raise_aborted(rank_, fmt::format("{} to rank {}", detail::describe_op(options), options.peer));
    }
    const detail::MailKey key = state_->key(rank_, options.peer, options);
    auto& box = state_->mail[key];
    if (!box.receives.empty()) {
      auto recv = std::move(box.receives.front());
      box.receives.pop_front();
      recv->payload = std::move(payload);
      recv->written = std::move(written);
      recv->tag = options.tag;
      recv->label = detail::describe_op(options);
      recv->matched = true;
      send->matched = true;
      state_->wakeup[options.peer].notify_all();
    } else {
      box.messages.push_back(
          detail::Message{std::move(payload), send, std::move(written), options.tag, detail::describe_op(options)});
    }
    if (box.empty()) state_->mail.erase(key);
  }
  return std::make_unique<detail::LocalSendWork>(state_, rank_, options, std::move(send));
}

std::unique_ptr<Work> LocalTransport::irecv(at::Tensor& buffer, const P2POptions& options) {
  detail::check_p2p_args("irecv", rank_, state_->world, buffer, options);
  auto recv = std::make_shared<detail::RecvState>();
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->aborted()) {
      state_->raise_aborted(rank_, fmt::format("{} from rank {}", detail::describe_op(options), options.peer));
    }
    const detail::MailKey key = state_->key(options.peer, rank_, options);
    auto& box = state_->mail[key];
    if (!box.messages.empty()) {
      auto message = std::move(box.messages.front());
      box.messages.pop_front();
      recv->payload = std::move(message.payload);
      recv->written = std::move(message.written);
      recv->tag = message.tag;
      recv->label = std::move(message.label);
      recv->matched = true;
      message.send->matched = true;
      // The sender may be blocked in a synchronous send's wait().
      state_->wakeup[options.peer].notify_all();
    } else {
      box.receives.push_back(recv);
    }
    if (box.empty()) state_->mail.erase(key);
  }
  return std::make_unique<detail::LocalRecvWork>(state_, rank_, options, buffer, std::move(recv));
}

namespace {

// This rank's contribution to a collective: a host snapshot that the collective owns (the other ranks read it while
// this one may already modify `tensor`). Device tensors travel through host copies (the copy waits for this rank's
// stream); Local collectives are for small tensors and tests, so the copies cost nothing worth a stream protocol.
at::Tensor host_snapshot(const at::Tensor& tensor) {
  return tensor.is_cpu() ? tensor.clone(at::MemoryFormat::Contiguous) : tensor.to(at::kCPU).contiguous();
}

// "tensor [3] Float": how a collective's signature names a tensor every rank must pass alike.
std::string signature_of(const char* role, at::IntArrayRef sizes, c10::ScalarType dtype) {
  return fmt::format("{} {}", role, detail::describe_tensor(sizes, dtype));
}

}  // namespace

void LocalTransport::all_reduce_sum(at::Tensor& tensor, Duration timeout) {
  TWOBP_CHECK(tensor.defined(), UsageError, "{}: all_reduce_sum of an undefined tensor", state_->who(rank_));
  const at::Tensor sum = collective("all_reduce_sum", host_snapshot(tensor),
                                    signature_of("tensor", tensor.sizes(), tensor.scalar_type()), Combine::kSum,
                                    timeout);
  tensor.copy_(sum);
}

void LocalTransport::barrier(Duration timeout) { collective("barrier", at::Tensor(), "", Combine::kNothing, timeout); }

void LocalTransport::broadcast(at::Tensor& tensor, int root, Duration timeout) {
  TWOBP_CHECK(tensor.defined(), UsageError, "{}: broadcast of an undefined tensor", state_->who(rank_));
  TWOBP_CHECK(root >= 0 && root < state_->world, UsageError, "{}: broadcast from root {}: no such rank (world size {})",
              state_->who(rank_), root, state_->world);
  // The root is part of the collective's kind: ranks disagreeing about it get the same UsageError as ranks
  // calling different collectives.
  const at::Tensor result =
      collective(fmt::format("broadcast from rank {}", root), host_snapshot(tensor),
                 signature_of("tensor", tensor.sizes(), tensor.scalar_type()), Combine::kRoot, timeout, root);
  tensor.copy_(result);
}

void LocalTransport::reduce_scatter_sum(const at::Tensor& input, at::Tensor& output, Duration timeout) {
  detail::check_reduce_scatter_args(state_->who(rank_), state_->world, rank_, input, output);
  // The whole inputs are summed in rank order (all_reduce_sum's sum, bitwise); each rank copies its shard out.
  const at::Tensor sum = collective("reduce_scatter_sum", host_snapshot(input),
                                    signature_of("input", input.sizes(), input.scalar_type()), Combine::kSum, timeout);
  const ShardRange mine = shard_range(input.numel(), state_->world, rank_);
  output.copy_(sum.narrow(0, mine.begin, mine.size()));
}

void LocalTransport::all_gather(const at::Tensor& shard, at::Tensor& output, Duration timeout) {
  detail::check_all_gather_args(state_->who(rank_), state_->world, rank_, shard, output);
  // The signature is the output's: the ranks' shards differ in size by design, their outputs must not.
  const at::Tensor all = collective("all_gather", host_snapshot(shard),
                                    signature_of("output", output.sizes(), output.scalar_type()), Combine::kConcat,
                                    timeout);
  output.copy_(all);
}

std::unique_ptr<Transport> LocalTransport::split(int color, int key, Duration timeout) {
  const std::int64_t number = splits_++;
  const auto colors = detail::gather_split_colors(*this, color, key, timeout);
  if (color < 0) return nullptr;
  const std::vector<int> members = detail::split_members(colors, color);
  const auto me = std::find(members.begin(), members.end(), rank_);
  std::shared_ptr<detail::LocalGroupState> group;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto& pending = state_->splits[{number, color}];
    if (!pending.state) {
      LocalOptions options = state_->options;
      if (options.devices.size() > 1) {
        options.devices.clear();
        for (int m : members) options.devices.push_back(state_->options.devices[static_cast<std::size_t>(m)]);
      }
      std::vector<std::string> names;
      for (int g = 0; g < static_cast<int>(members.size()); ++g) {
        names.push_back(detail::group_member_name(g, color, state_->who(members[g])));
      }
      pending.state = std::make_shared<detail::LocalGroupState>(static_cast<int>(members.size()), std::move(options),
                                                                std::move(names), state_->family);
      std::lock_guard<std::mutex> family_lock(state_->family->mutex);
      state_->family->members.push_back(pending.state);
      pending.untaken = static_cast<int>(members.size());
    }
    group = pending.state;
    if (--pending.untaken == 0) state_->splits.erase({number, color});
  }
  return std::make_unique<LocalTransport>(std::move(group), static_cast<int>(me - members.begin()));
}

namespace detail {
namespace {

// Records `me`'s arrival in the collective being assembled, after checking that it is the same collective as the
// ranks' already there (kind and signature). A mismatch leaves the collective unable to complete: it is recorded so
// that the other ranks fail at once instead of waiting for their timeout, and raised here as UsageError. Caller holds
// the mutex.
void arrive(LocalGroupState& s, int me, const std::string& kind, at::Tensor contribution, const std::string& signature,
            const std::string& what) {
  auto fail_usage = [&](std::string message) {
    s.failure = message;
    s.notify_all_ranks();
    throw UsageError(message);
  };
  if (s.arrived == 0) {
    s.kind = kind;
    s.contributions.assign(s.world, at::Tensor());
    s.signatures.assign(s.world, std::string());
    s.has_arrived.assign(s.world, false);
  } else {
    int first = 0;
    while (!s.has_arrived[first]) ++first;
    if (s.kind != kind) {
      fail_usage(fmt::format("{} called {} while rank {} called {} (collective #{}): every rank must call "
                             "the collectives in the same order",
                             s.who(me), kind, first, s.kind, s.generation));
    }
    if (s.signatures[first] != signature) {
      fail_usage(fmt::format("{}: {}: {} does not match rank {}'s {}", s.who(me), what, signature, first,
                             s.signatures[first]));
    }
  }
  s.contributions[me] = std::move(contribution);
  s.signatures[me] = signature;
  s.has_arrived[me] = true;
  ++s.arrived;
}

// The result of the assembled collective, made by the last rank to arrive (`me`) from the contributions in rank
// order -- a sum in rank order is bitwise reproducible. Caller holds the mutex.
at::Tensor combine(LocalGroupState& s, int me, const std::string& what, LocalCombine how, int root) {
  using Combine = LocalCombine;
  try {
    switch (how) {
      case Combine::kNothing: return at::Tensor();
      case Combine::kRoot: return s.contributions[root];
      case Combine::kConcat: return at::cat(s.contributions);
      case Combine::kSum: {
        at::Tensor sum = s.contributions[0];
        for (int r = 1; r < s.world; ++r) sum.add_(s.contributions[r]);
        return sum;
      }
    }
  } catch (const std::exception& e) {
    s.failure = fmt::format("{}: {}: combining the contributions failed: {}", s.who(me), what, e.what());
    s.notify_all_ranks();
    throw TransportError(s.failure);
  }
  return at::Tensor();
}

}  // namespace
}  // namespace detail

at::Tensor LocalTransport::collective(const std::string& kind, at::Tensor contribution, const std::string& signature,
                                      Combine combine, Duration timeout, int root) {
  const auto deadline = detail::deadline_after(timeout);
  auto& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  const std::int64_t my_generation = s.generation;
  const std::string what = fmt::format("{} #{}", kind, my_generation);
  if (s.aborted()) s.raise_aborted(rank_, what);
  if (!s.failure.empty()) detail::raise<TransportError>("{}: {} failed: {}", state_->who(rank_), what, s.failure);
  detail::arrive(s, rank_, kind, std::move(contribution), signature, what);

  if (s.arrived == s.world) {
    // Last to arrive: combine, publish, open the next generation.
    // WHY a single last_result suffices: generation+1 cannot complete before every rank arrived at it, i.e.
    // before every rank returned from this one and took the result.
    s.last_result = detail::combine(s, rank_, what, combine, root);
    s.contributions.clear();
    s.arrived = 0;
    ++s.generation;
    s.notify_all_ranks();
    return s.last_result;
  }
  s.wakeup[rank_].wait_until(lock, deadline, [&] {
    return s.aborted() || !s.failure.empty() || s.generation > my_generation;
  });
  if (s.generation > my_generation) return s.last_result;  // completed before any abort: its result is valid
  if (s.aborted()) s.raise_aborted(rank_, what);
  if (!s.failure.empty()) detail::raise<TransportError>("{}: {} failed: {}", state_->who(rank_), what, s.failure);
  // The deadline passed.
  std::string missing;
  for (int r = 0; r < s.world; ++r) {
    if (!s.has_arrived[r]) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
  }
  // Our contribution is already in the collective and cannot be withdrawn: the collective is broken for all.
  s.failure = fmt::format("{}: timed out after {} ms in {} waiting for rank(s) {}", state_->who(rank_),
                          timeout.count(), what, missing);
  s.notify_all_ranks();
  throw TimeoutError(s.failure);
}

void LocalTransport::abort(const std::string& reason) {
  auto& family = *state_->family;
  std::vector<std::shared_ptr<detail::LocalGroupState>> states;
  {
    std::lock_guard<std::mutex> lock(family.mutex);
    if (family.aborted.load()) return;  // the first abort's reason is what everyone reports
    family.abort_who = state_->who(rank_);
    family.abort_reason = reason;
    family.aborted.store(true);
    for (const auto& weak : family.members) {
      if (auto st = weak.lock()) states.push_back(std::move(st));
    }
  }
  for (const auto& st : states) {  // one mutex at a time: no lock order to get wrong
    std::lock_guard<std::mutex> lock(st->mutex);
    st->notify_all_ranks();
  }
}

LocalTransportGroup::LocalTransportGroup(int world_size, LocalOptions options) {
  TWOBP_CHECK(world_size >= 1, UsageError, "LocalTransportGroup: world size must be >= 1, got {}", world_size);
  TWOBP_CHECK(options.devices.size() <= 1 || options.devices.size() == static_cast<std::size_t>(world_size),
              UsageError, "LocalTransportGroup: LocalOptions::devices has {} entries for {} ranks: expected 0, 1 or {}",
              options.devices.size(), world_size, world_size);
  auto state = std::make_shared<detail::LocalGroupState>(world_size, options);
  state->family->members.push_back(state);
  transports_.reserve(world_size);
  for (int r = 0; r < world_size; ++r) transports_.push_back(std::make_unique<LocalTransport>(state, r));
}

LocalTransport& LocalTransportGroup::transport(int rank) {
  TWOBP_CHECK(rank >= 0 && rank < static_cast<int>(transports_.size()) && transports_[rank], UsageError,
              "LocalTransportGroup: no transport for rank {} (world size {}, or release() was called)", rank,
              transports_.size());
  return *transports_[rank];
}

std::vector<std::unique_ptr<Transport>> LocalTransportGroup::release() {
  std::vector<std::unique_ptr<Transport>> out;
  out.reserve(transports_.size());
  for (auto& t : transports_) out.push_back(std::move(t));
  transports_.clear();
  return out;
}

std::vector<std::unique_ptr<Transport>> make_local_transports(int world_size, LocalOptions options) {
  return LocalTransportGroup(world_size, options).release();
}

}  // namespace twobp
