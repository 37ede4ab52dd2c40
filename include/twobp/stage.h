#pragma once
// A Stage is one pipeline chunk: a module plus the bookkeeping that lets its backward run either fused
// (ordinary backprop, action B) or split by 2BP into stage 1 (I: input gradient) and stage 2 (W: weight
// gradients, possibly for several micro-batches at once).

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "twobp/autograd/weight_grad_store.h"
#include "twobp/tensors.h"

namespace torch::nn {
class Module;
}

namespace twobp {

namespace detail {
struct SplitPlan;

/// The states of some generators, to replay a forward (restore) or to tell whether anything drew from them.
struct RngState {
  /// LibTorch's process-wide default generators a forward on `device` may draw from: the CPU one, and the
  /// device's own for a CUDA device.
  static std::vector<at::Generator> defaults(c10::Device device);
  static RngState capture(const std::vector<at::Generator>& generators);
  /// The current states of the same generators.
  RngState now() const;
  void restore() const;
  /// Whether every generator is in the state `other` recorded for it (same generators, same order).
  bool same_as(const RngState& other) const;
  std::vector<std::pair<at::Generator, at::Tensor>> states;
};
}  // namespace detail

namespace detail {
template <typename F, typename... Args>
constexpr bool returns_v = std::is_invocable_r_v<at::Tensor, F&, const Args&...>;
}  // namespace detail

/// The chunk's forward. Either form converts implicitly (usually a lambda around the module's forward()):
///   [](const at::Tensor& input) -> at::Tensor          one tensor in, one out
///   [](const NamedTensors& inputs) -> NamedTensors     several named tensors (see twobp/tensors.h)
class StageForward {
 public:
  StageForward() = default;
  StageForward(std::nullptr_t) {}  // NOLINT(google-explicit-constructor)
  template <typename F, std::enable_if_t<std::is_invocable_r_v<NamedTensors, F&, const NamedTensors&> &&
                                             !std::is_same_v<std::decay_t<F>, StageForward>,
                                         int> = 0>
  StageForward(F f) : multi_(std::move(f)) {}  // NOLINT(google-explicit-constructor)
  template <typename F, std::enable_if_t<detail::returns_v<F, at::Tensor> &&
                                             !std::is_invocable_r_v<NamedTensors, F&, const NamedTensors&> &&
                                             !std::is_same_v<std::decay_t<F>, StageForward>,
                                         int> = 0>
  StageForward(F f) : single_(std::move(f)) {}  // NOLINT(google-explicit-constructor)

  explicit operator bool() const { return single_ || multi_; }
  /// Whether it takes NamedTensors (then the last stage's forward also sees the targets among its inputs).
  bool takes_named_tensors() const { return static_cast<bool>(multi_); }
  /// Runs it; a one-tensor forward needs exactly one input (`where` names the stage in the error otherwise).
  NamedTensors call(const NamedTensors& inputs, std::string_view where) const;
  NamedTensors operator()(const NamedTensors& inputs) const { return call(inputs, "forward"); }

 private:
  std::function<at::Tensor(const at::Tensor&)> single_;
  std::function<NamedTensors(const NamedTensors&)> multi_;
};

/// Computes a scalar loss from the last stage's output(s) and the micro-batch's target(s). Either form converts:
///   [](const at::Tensor& output, const at::Tensor& target) -> at::Tensor
///   [](const NamedTensors& outputs, const NamedTensors& targets) -> at::Tensor
class LossFunction {
 public:
  LossFunction() = default;
  LossFunction(std::nullptr_t) {}  // NOLINT(google-explicit-constructor)
  template <typename F, std::enable_if_t<detail::returns_v<F, NamedTensors, NamedTensors> &&
                                             !std::is_same_v<std::decay_t<F>, LossFunction>,
                                         int> = 0>
  LossFunction(F f) : multi_(std::move(f)) {}  // NOLINT(google-explicit-constructor)
  template <typename F, std::enable_if_t<detail::returns_v<F, at::Tensor, at::Tensor> &&
                                             !detail::returns_v<F, NamedTensors, NamedTensors> &&
                                             !std::is_same_v<std::decay_t<F>, LossFunction>,
                                         int> = 0>
  LossFunction(F f) : single_(std::move(f)) {}  // NOLINT(google-explicit-constructor)

  explicit operator bool() const { return single_ || multi_; }
  /// Runs it; the one-tensor form needs exactly one output and one target.
  at::Tensor call(const NamedTensors& outputs, const NamedTensors& targets, std::string_view where) const;
  at::Tensor operator()(const NamedTensors& outputs, const NamedTensors& targets) const {
    return call(outputs, targets, "loss");
  }

 private:
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> single_;
  std::function<at::Tensor(const NamedTensors&, const NamedTensors&)> multi_;
};

struct StageOptions {
  int stage_index = 0;  ///< global stage index, used in error messages and to decide on input gradients
  int num_stages = 1;
  int rank = 0;  ///< owning rank, used in error messages
  /// Set on the last stage: forward() then returns loss(output, target) and backward starts from it.
  LossFunction loss;
  /// Gradient seeded into a scalar loss. The Pipeline sets it to 1/num_micro_batches so that the summed
  /// gradients of a step equal those of the mean loss over the whole batch.
  double loss_scale = 1.0;
  /// Stage 2 of several micro-batches hands all their queued work to each layer's kernel in one call, which may
  /// concatenate it into one GEMM (nn::functional::Batching::kAuto: on CUDA for small micro-batches).
  bool batch_weight_grads = true;
  /// Activation recomputation: F keeps only the stage's inputs (and targets), dropping its graph and saved
  /// activations; the first I or B of the micro-batch re-runs the forward under autograd -- with F's random state,
  /// so dropout draws the same masks, and putting buffers back afterwards, so running statistics are updated once
  /// -- then proceeds as usual (W still needs only what I left). Gradients are unchanged; the recompute time is
  /// part of that I or B (take_recompute_us()). Other side effects of the forward happen twice. The re-run's
  /// outputs are compared with F's: a forward that draws from a generator not replayed (see below) or is otherwise
  /// not reproducible is refused with a UsageError naming the stage and micro-batch, instead of training on
  /// gradients of another forward.
  bool recompute = false;
  /// Generators the forward draws from besides the default CPU (and the device's CUDA) generator, e.g. a module's
  /// own dropout generator: replayed like the defaults when recomputing. Each must belong to this stage alone.
  std::vector<at::Generator> replay_generators;
  /// The seed of the stage's random streams: every forward runs in a StageRandomScope keyed by (seed, stage_index,
  /// micro-batch, pass), where stage_generator() and nn::Dropout draw (twobp/random.h).
  uint64_t seed = 0;
  /// Other threads of this process run stages at the same time (ranks as threads; the Pipeline sets it from
  /// Transport::ranks_share_process()). LibTorch's default generators are then shared with them, so a forward
  /// that draws from one -- or during which another thread did -- is refused with a UsageError (draw from
  /// stage_generator() / nn::Dropout, or run ranks as processes), and recomputation neither captures nor restores
  /// them (it replays the stage's own streams and replay_generators).
  bool ranks_share_process = false;
};

/// `tensors` without repeats, by tensor identity, in first-seen order. Module::parameters() lists a tensor once
/// per name it is registered under; optimizers, norms and clipping must see it once.
std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors);

/// One chunk of a pipeline.
///
/// Per micro-batch lifecycle (every call names the micro-batch; a violation throws UsageError naming stage and
/// micro-batch):
///   forward(mb) ──► backward(mb)                               ordinary backprop
///   forward(mb) ──► backward_input(mb) ──► backward_weight({mb, ...})   2BP
///
/// What is alive between the calls:
///  - after forward: the autograd graph of the micro-batch with all saved activations.
///  - after backward_input: fast-path layers keep only (input, grad_output) per layer (Linear: x and dY;
///    RMSNorm: x̂ and dY; Embedding: ids and dY); for other modules (general path) the weight-bearing nodes
///    of the graph that have an edge to a parameter keep their saved tensors and the gradient flowing into them
///    ("frontier" nodes), every other node's saved tensors are released.
///  - after backward_weight or backward: nothing; the micro-batch is forgotten and may be reused next step.
///
/// Parameter gradients are accumulated (summed) into .grad across micro-batches; zero them between steps.
/// A Stage is used by one thread at a time.
class Stage {
 public:
  Stage(std::shared_ptr<torch::nn::Module> module, StageForward forward, StageOptions options);
  ~Stage();
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

  /// Runs the chunk on `inputs` (the previous stage's outputs, or the first stage's data). `targets` is the last
  /// stage's data: passed to the loss, and -- to a forward taking NamedTensors -- among its inputs too (labels,
  /// masks, position ids reach the last stage without being relayed; their names must differ from the inputs').
  /// An input gets a gradient (returned by I or B) when the stage is not the first, the tensor is floating-point
  /// and requires grad. Returns the outputs, detached (the loss, named "loss", on the last stage); an output
  /// carries a gradient when it requires grad (see NamedTensors) and is then returned as a leaf that requires
  /// grad, so that it can be handed to the next stage as is.
  NamedTensors forward(int micro_batch, const NamedTensors& inputs, const NamedTensors& targets);
  /// One-tensor form: on stages after the first, a floating-point input always gets a gradient.
  at::Tensor forward(int micro_batch, const at::Tensor& input, const at::Tensor& target = {});

  /// Evaluation: the forward of one micro-batch (and on the last stage its loss) without autograd, keeping
  /// nothing -- no graph, no micro-batch state, no gradient touched -- so it may run between training steps
  /// whatever the step left. Returns the outputs as forward() does (the loss, named "loss", on the last stage),
  /// none requiring grad. The module runs in whatever train/eval mode it is in (Pipeline::evaluate switches
  /// to eval()). Its random draws come from the stage's streams under the evaluation key (pass -1): the same
  /// numbers in every evaluation, none taken from a training forward's. Draws from LibTorch's default generator
  /// are refused when ranks share the process, as in forward().
  NamedTensors evaluate(int micro_batch, const NamedTensors& inputs, const NamedTensors& targets);

  /// 2BP stage 1: the gradients w.r.t. the stage inputs, to be sent upstream. `grad_outputs` names a gradient for
  /// outputs that carry one (matching its shape and dtype); an output it omits, or names with an undefined
  /// tensor, contributes nothing -- as a tensor the rest of the model does not use. On the last stage (scalar
  /// loss) it may be empty and loss_scale is used. Returns one entry per input that gets a gradient, undefined
  /// when no output depends on that input (its producer's parameters then get no gradient from it).
  NamedTensors backward_input(int micro_batch, const NamedTensors& grad_outputs);
  /// One-tensor form: returns zeros where the input got no gradient, undefined on the first stage.
  at::Tensor backward_input(int micro_batch, const at::Tensor& grad_output = {});

  /// 2BP stage 2 for micro-batches whose backward_input ran, in any order; accumulates into .grad.
  /// `done`, when given, is called during the W with parameters whose gradient no later part of this W writes
  /// (fast-path layers' parameters as each layer finishes; general-path leaves are not reported). The caller
  /// passes it on the stage's last W of a step, to start reducing those gradients while the W goes on.
  void backward_weight(const std::vector<int>& micro_batches, const autograd::ParametersDone& done = nullptr);

  /// Ordinary (fused) backprop for one micro-batch: returns the input gradients (as backward_input) and
  /// accumulates into .grad.
  NamedTensors backward(int micro_batch, const NamedTensors& grad_outputs);
  at::Tensor backward(int micro_batch, const at::Tensor& grad_output = {});

  /// Forgets every micro-batch of the current step (after an error), releasing its memory.
  void reset();

  const StageOptions& options() const { return options_; }
  /// Sets StageOptions::loss_scale for the following micro-batches (the Pipeline does so before each step under
  /// LossReduction::kMeanOverItems: 1 / the global batch's items). Only between steps, like set_recompute.
  void set_loss_scale(double scale);
  /// Turns activation recomputation (StageOptions::recompute) on or off for the following micro-batches. Only
  /// between steps: throws UsageError, naming the stage, while it holds a micro-batch. Gradients are unchanged.
  void set_recompute(bool on);
  torch::nn::Module& module() const { return *module_; }
  /// The module's parameters, each tensor once (a submodule registered under two names, or a tied weight, is
  /// listed once). Trainable leaves the forward uses without registering them still get gradients, as with
  /// loss.backward(), but are not listed here (nor clipped, checkpointed or optimized by what uses this list).
  std::vector<at::Tensor> parameters() const;
  /// Micro-batches with state held (forwarded and not yet fully backpropagated).
  std::size_t live_micro_batches() const { return micro_batches_.size(); }
  /// Micro-batches whose I ran and whose W has not: the deferred weight work this stage holds.
  std::size_t pending_weight_micro_batches() const;
  autograd::WeightGradStore& weight_grad_store() { return store_; }
  /// Microseconds spent re-running forwards (StageOptions::recompute) since the last call; resets to 0.
  double take_recompute_us();

 private:
  enum class Phase { kForwarded, kInputGradDone };
  struct MicroBatch {
    Phase phase = Phase::kForwarded;
    NamedTensors inputs;   // the leaves input gradients are taken against (those requiring grad)
    NamedTensors outputs;  // the outputs (or the loss) the backward starts from, with their graph
    std::unique_ptr<detail::SplitPlan> plan;  // general-path stage-2 work, after backward_input
    // Recomputation: F's random state and targets, until the forward was re-run.
    bool recompute_pending = false;
    int64_t pass = 0;  // forwards of this micro-batch before this one: the key of its random streams
    detail::RngState rng;
    NamedTensors targets;
    NamedTensors forwarded;  // F's outputs (detached), to check the re-run against
  };

  NamedTensors run_forward(int micro_batch, int64_t pass, const NamedTensors& inputs, const NamedTensors& targets);
  // The user's forward (targets added for a NamedTensors forward on the last stage) and, on the last stage, the
  // loss; in whatever grad mode and scopes the caller set.
  NamedTensors call_forward(int micro_batch, const NamedTensors& inputs, const NamedTensors& targets);
  // Runs `body` (a forward); with ranks sharing the process, refuses it if LibTorch's default generator moved.
  NamedTensors refusing_default_draws(int micro_batch, const std::function<NamedTensors()>& body);
  void recompute(int micro_batch, MicroBatch& state);
  // What recomputation captures and replays besides the stage's own streams (see StageOptions).
  std::vector<at::Generator> replayed_generators() const;
  // Queues the comparison of the re-run's outputs with F's (computed where they live, read later).
  void check_recomputed(int micro_batch, const MicroBatch& state);
  // Reads the queued comparisons in one copy and raises for the first that failed. Called when no micro-batch
  // waits for its recomputation any more (at the latest: the step's last I or B), so a step with recomputation
  // synchronizes with the device for it once, not twice per output and micro-batch.
  void verify_recomputed();
  c10::Device device() const;

  MicroBatch& lookup(int micro_batch, const char* action);
  // The (output, seed) pairs a backward starts from: outputs with a defined gradient in `grad_outputs`.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> seeds(int micro_batch, const MicroBatch& state,
                                                                     const NamedTensors& grad_outputs) const;
  // The inputs that get a gradient, and which of them got none.
  static std::vector<at::Tensor> gradient_inputs(const MicroBatch& state, std::vector<std::string>* names);
  // The one-tensor forms of I and B: the NamedTensors call they make, and the input for zeros_like.
  struct SingleCall {
    at::Tensor input;
    NamedTensors grad_outputs;
  };
  SingleCall single_call(int micro_batch, const char* action, const at::Tensor& grad_output);
  at::Tensor single_gradient(int micro_batch, const SingleCall& call, const NamedTensors& grads) const;
  std::string where(int micro_batch) const;
  // The module's parameters when all of them belong to fast-path layers (decided at the first I), else null:
  // I then skips the general split's graph analysis unless a graph uses one through ordinary ops.
  const std::vector<at::Tensor>* fast_path_parameters();

  std::shared_ptr<torch::nn::Module> module_;
  StageForward forward_;
  StageOptions options_;
  autograd::WeightGradStore store_;
  std::map<int, MicroBatch> micro_batches_;
  std::map<int, int64_t> passes_;  // per micro-batch index: forwards run so far (F's, not recomputations)
  double recompute_us_ = 0.0;
  struct RecomputeCheck {
    int micro_batch;
    std::string name;
    double tolerance;   // relative; 0 for integer outputs (any difference fails)
    at::Tensor errors;  // [norm of the difference, norm of F's output], float64, on the outputs' device
  };
  std::vector<RecomputeCheck> recompute_checks_;
  bool fast_path_decided_ = false, fast_only_ = false;
  std::vector<at::Tensor> fast_path_parameters_;
};

}  // namespace twobp
