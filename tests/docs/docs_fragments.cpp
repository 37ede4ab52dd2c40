// Harness of the C++ blocks of docs/USAGE.md and docs/DATA_PARALLEL.md (tests/scripts/doc_blocks.py puts each at
// its marked line, after the blocks' own #include lines). It includes nothing itself: the run_ranks block must
// compile with exactly the header it shows (twobp/twobp.h), the attribution block with that and its fmt. Each
// fragment becomes the body of a function whose parameters are what it leaves to the reader (a pipeline, the data,
// a timeout, ...): compiled and linked, not run, since each needs a job around it. The run_ranks block is a whole
// job and runs in main(): 2 rank threads train one ZB-V step with 2BP (docs_snippets runs this program).

namespace {

at::Tensor masked_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask) {
  return (logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask).sum().neg() / mask.sum();
}

// A transformer block's shape: hidden states, positions and a document mask in, hidden states out.
struct BlockImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& /*positions*/, const at::Tensor& /*doc_ids*/) {
    return hidden;
  }
};
TORCH_MODULE(Block);

struct Optimizer {
  void step() {}
};

struct MyChunkImpl : torch::nn::Module {
  explicit MyChunkImpl(int /*stage*/) : linear(register_module("linear", twobp::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return linear(x).tanh(); }
  twobp::nn::Linear linear;
};
TORCH_MODULE(MyChunk);

}  // namespace

namespace usage_named_tensors {
void run(twobp::Pipeline& pipeline, twobp::PipelineOptions& options, std::vector<twobp::PipelineChunk>& chunks,
         int stage, Block block, const at::Tensor& ids, const at::Tensor& pos, const at::Tensor& docs,
         const at::Tensor& next, const at::Tensor& mask, const twobp::NamedTensors& mb0_inputs,
         const twobp::NamedTensors& mb1_inputs, const twobp::NamedTensors& mb0_targets,
         const twobp::NamedTensors& mb1_targets) {
  // @snippet usage_named_tensors@
}
}  // namespace usage_named_tensors

namespace usage_attribution {
void run(twobp::Pipeline& pipeline, const at::Tensor& inputs, const at::Tensor& targets, int step,
         Optimizer& optimizer, std::vector<twobp::StepAttribution>& steps, twobp::Duration timeout) {
  // @snippet usage_attribution@
}
}  // namespace usage_attribution

namespace usage_measured_costs {
void run(twobp::Pipeline& pipeline, const at::Tensor& inputs, const at::Tensor& targets, int steps,
         twobp::Duration timeout, twobp::ParallelGroups& groups, int p, int m) {
  // @snippet usage_measured_costs@
}
}  // namespace usage_measured_costs

namespace data_parallel_groups {
void run(twobp::Transport& world, int dp, twobp::Duration timeout, const twobp::Schedule& schedule,
         std::vector<twobp::PipelineChunk> my_chunks, const at::Tensor& my_share_of_inputs,
         const at::Tensor& my_share_of_targets) {
  // @snippet data_parallel_groups@
}
}  // namespace data_parallel_groups

int main() {
  twobp::PipelineOptions options;
  options.loss = [](const at::Tensor& output, const at::Tensor& target) { return (output - target).pow(2).mean(); };
  const at::Tensor inputs = at::randn({16, 8});
  const at::Tensor targets = at::randn({16, 8});
  // @snippet usage_run_ranks@
  return 0;
}
