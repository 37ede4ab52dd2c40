#pragma once
// The fast path of the 2BP split: layers whose weight gradient is a GEMM (or a reduction) compute only the input
// gradient in autograd's backward (stage 1, "I") and queue the (input, grad_output) pair here; stage 2 ("W")
// drains the queue, optionally concatenating several micro-batches into one larger GEMM per layer.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace twobp::autograd {

/// What stage 2 needs to compute one layer's parameter gradients for one use of the layer.
struct WeightGradItem {
  /// Layer-specific: the layer input (Linear, the fused RMSNorm), token ids (Embedding), x̂ (composite RMSNorm).
  at::Tensor input;
  at::Tensor grad_output;  ///< gradient w.r.t. the layer output
  at::Tensor aux = {};     ///< layer-specific extra, or undefined: the fused RMSNorm's 1/rms per row
};

/// Throws UsageError when a parameter written by a fast-path layer has a gradient hook (Tensor::register_hook):
/// fast-path layers compute weight gradients outside autograd, where such a hook (which may change the gradient
/// before it is accumulated) cannot run as loss.backward() runs it. `layer` names the kernel, `context` the stage
/// and micro-batch. Post-accumulate-grad hooks are supported (see WeightGradStore).
void check_no_gradient_hooks(const at::Tensor& param, const std::string& layer, const std::string& context);

/// Implemented by every fast-path layer. accumulate_weight_grad() adds the parameter gradients of all `items`
/// to the parameters' .grad (creating it when undefined). Several items (micro-batches, or repeated uses of a
/// layer) may be reduced in one call: implementations may concatenate them so that one GEMM does the work.
class WeightGradKernel {
 public:
  virtual ~WeightGradKernel() = default;
  virtual void accumulate_weight_grad(c10::ArrayRef<WeightGradItem> items) const = 0;
  virtual std::string kernel_name() const = 0;
  /// The tensors accumulate_weight_grad() may write the .grad of. Empty means "not known": a W that runs such a
  /// kernel then reports no parameter complete before it ended (see WeightGradStore::run).
  virtual std::vector<at::Tensor> weight_grad_parameters() const { return {}; }
};

/// Told, during a W, of parameters no later kernel of that W writes: if the W is the last of the step for the
/// stage, their gradients are final (data-parallel reduction starts on them while W goes on).
using ParametersDone = std::function<void(const std::vector<at::Tensor>& params)>;

/// When a fast-path layer's backward runs, does it compute its weight gradient now or defer it?
enum class WeightGradPolicy {
  kImmediate,  ///< ordinary backprop (action B, or plain loss.backward()): accumulate into .grad at once
  kDeferred,   ///< 2BP stage 1 (action I): queue the work for backward_weight()
};

/// Per-stage queue of deferred weight-gradient work, keyed by micro-batch.
///
/// Post-accumulate-grad hooks of fast-path parameters fire as AccumulateGrad fires them in loss.backward(): once
/// per micro-batch (per backward) in which the parameter got a gradient, after every use of it in that
/// micro-batch was accumulated (a tied weight fires once). In W, a run whose layers have such hooks is therefore
/// computed micro-batch by micro-batch (no concatenation across micro-batches); after an immediate-mode backward
/// (B) the Stage calls fire_immediate_hooks(). A hooked parameter that ordinary ops use as well (where autograd's
/// AccumulateGrad fires it too) is refused with a UsageError.
///
/// Contract: every WeightGradKernel pushed here must outlive the queued work (Stage owns both its module and its
/// store and clears the store first). push() may be called from autograd's device threads while the owning
/// thread blocks in backward, so the queue is locked; run() is called by the owning thread only.
class WeightGradStore {
 public:
  WeightGradStore();
  WeightGradStore(const WeightGradStore&) = delete;
  WeightGradStore& operator=(const WeightGradStore&) = delete;

  WeightGradPolicy policy() const { return policy_.load(); }
  void set_policy(WeightGradPolicy policy) { policy_.store(policy); }

  /// "rank R stage S": prefixed to the errors raised about work recorded in this store. Set once by the owner.
  void set_context(std::string context) { context_ = std::move(context); }
  const std::string& context() const { return context_; }

  /// Called from a fast-path layer's backward. kImmediate: runs the kernel now; kDeferred: queues the item and
  /// remembers the version counters of its tensors, so that run() can refuse an item modified in place since.
  void on_backward(std::int64_t micro_batch, const WeightGradKernel* kernel, WeightGradItem item);

  /// Stage 2 for `micro_batches`: groups queued items by layer (in first-queued order, so the result does not
  /// depend on hash order) and runs each layer's kernel once over all of them when `batched`, else once per
  /// micro-batch. The queued items are released afterwards. Throws UsageError, before running any kernel, when a
  /// queued tensor was modified in place after it was queued (the result would silently be wrong).
  /// `done`, when given, is called after each kernel call with the parameters of that kernel that no later call
  /// of this run writes (never when some kernel of the run does not list its parameters). `general_leaves`: the
  /// tensors the general path accumulates for these micro-batches (a hooked parameter among them is refused).
  void run(c10::ArrayRef<std::int64_t> micro_batches, bool batched, const ParametersDone& done = nullptr,
           const std::vector<at::Tensor>& general_leaves = {});

  /// After an immediate-mode backward (B): fires the post-accumulate-grad hooks of the fast-path parameters that
  /// backward accumulated into, once each. Throws UsageError for a hooked parameter autograd also accumulated.
  void fire_immediate_hooks();

  /// Number of queued items for a micro-batch (0 when none).
  std::size_t pending(std::int64_t micro_batch) const;
  /// Total bytes held by queued tensors (memory accounting for the benchmark and tests).
  std::int64_t pending_bytes() const;
  /// Drops queued work without running it (used when a step is abandoned after an error).
  void clear();  // also forgets hooks pending after an immediate backward

  /// A zero-element leaf that requires grad. Fast-path layers take it as an extra autograd input so that their
  /// output is part of the graph even when the layer input needs no gradient (token ids, first-stage images),
  /// and so that stage 1 can ask autograd for "everything reaching the fast-path layers" without naming
  /// parameters. Its gradient is always undefined.
  const at::Tensor& anchor() const { return anchor_; }

 private:
  struct Entry {
    const WeightGradKernel* kernel;
    WeightGradItem item;
    std::int64_t input_version = -1;  // -1: not tracked (undefined or inference tensor)
    std::int64_t micro_batch = 0;     // set when taken out of the queue
    std::int64_t grad_version = -1;
  };
  /// run()'s entries, taken out of the queue in micro-batch order -- or UsageError, the queue unchanged, when a
  /// saved tensor was modified in place since I.
  std::vector<Entry> take_entries(c10::ArrayRef<std::int64_t> micro_batches);
  std::atomic<WeightGradPolicy> policy_{WeightGradPolicy::kImmediate};
  mutable std::mutex mutex_;
  std::map<std::int64_t, std::vector<Entry>> queue_;
  std::vector<const WeightGradKernel*> immediate_hooked_;  // kernels with hooked parameters run by B
  at::Tensor anchor_;
  std::string context_;
};

/// While alive on the current thread, fast-path layers record into `store` under `micro_batch`; outside any
/// scope they run as ordinary LibTorch ops (so the layers are drop-in replacements in non-pipelined code).
class RecordingScope {
 public:
  RecordingScope(WeightGradStore& store, std::int64_t micro_batch);
  ~RecordingScope();
  RecordingScope(const RecordingScope&) = delete;
  RecordingScope& operator=(const RecordingScope&) = delete;

 private:
  WeightGradStore* previous_store_;
  std::int64_t previous_micro_batch_;
};

/// The store of the innermost RecordingScope on this thread, or nullptr.
WeightGradStore* current_store();
/// Its micro-batch (meaningless when current_store() is nullptr).
std::int64_t current_micro_batch();

/// Mixed precision: `param`'s gradients accumulate in `master`'s .grad (float32) instead of its own. The fast-path
/// kernels add theirs there directly (accumulate_grad, accumulate_matmul); what autograd accumulates into
/// param.grad (general-path layers) is moved there, and param.grad reset, by a post-accumulate-grad hook this
/// installs in the parameter's one slot. That hook is part of the accumulation, not a user hook: it neither turns
/// batched W off nor counts as a hook shared by the fast path and autograd. Throws UsageError when the slot is taken.
void set_master_gradient(const at::Tensor& param, const at::Tensor& master);

/// The tensor whose .grad receives `param`'s gradient: its master (set_master_gradient), else `param` itself.
at::Tensor gradient_holder(const at::Tensor& param);

/// Adds `grad` to the .grad of gradient_holder(param), creating it when undefined (converted to the holder's
/// dtype). Used by every weight-gradient kernel so that the accumulation semantics (sum over micro-batches and
/// over tied uses, into a float32 master under mixed precision) live in one place. `fresh` says `grad` is
/// referenced nowhere else, so it may become .grad without a copy.
void accumulate_grad(const at::Tensor& param, const at::Tensor& grad, bool fresh = true);

/// accumulate_grad(param, a · b) for matrices a [n, k] and b [k, m], with the sum done inside the GEMM where the
/// dtypes allow: addmm_ with beta = 1 into an existing .grad of the product's dtype; on CUDA, a bfloat16/float16
/// product straight into a float32 master's .grad (LibTorch's float32-output GEMMs, mm and baddbmm with
/// out_dtype). On the CPU a reduced-precision product into a float32 .grad is computed, then added (LibTorch 2.11
/// has no float32-output GEMM there).
void accumulate_matmul(const at::Tensor& param, const at::Tensor& a, const at::Tensor& b);

}  // namespace twobp::autograd
