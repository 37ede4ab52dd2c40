#pragma once
// The training state of a rank as named tensors -- its modules' parameters and buffers, its AdamW optimizer's state
// -- under the names a checkpoint stores them by: the format of that state, without the files. The kit's
// checkpoints (twobp/checkpoint.h) write and read these tensors; the core's ShardedOptimizer gathers and restores
// its share by the same names. Declared in twobp::checkpoint, where they were declared first.

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class AdamW;
}

namespace twobp::checkpoint {

/// Tensors by unique name, in a stable order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// The predicate of the tensors restore() takes for `params`: their names and their optimizer state's
/// ("optim.<name>.<field>", adamw_state_tensors). For checkpoint::load_checkpoint_by_name.
std::function<bool(const std::string&)> state_of(const NamedTensors& params);

/// Parameters and buffers of `module`, named "<prefix><name>". Tied parameters (the same tensor under two names)
/// appear once, under the first name.
NamedTensors module_tensors(const torch::nn::Module& module, const std::string& prefix = {});

/// The prefix of optimizer state names, and the name of one field of a parameter's state: "optim.<name>.<field>"
/// (the one rule every reader and writer of optimizer state uses).
inline constexpr const char* kOptimizerPrefix = "optim.";
std::string optimizer_state_name(const std::string& parameter, const std::string& field);

/// AdamW state of `params` (name -> parameter), as "optim.<name>.exp_avg", ".exp_avg_sq", ".step" (int64 scalar)
/// and ".max_exp_avg_sq" when amsgrad. Parameters the optimizer has not stepped yet have no entries.
NamedTensors adamw_state_tensors(const torch::optim::AdamW& optimizer, const NamedTensors& params);

/// Copies every tensor of `params` from `loaded` (same name, shape and dtype; converted to the parameter's device)
/// and restores AdamW state for them from the "optim.*" entries, as copies (later optimizer steps leave `loaded`
/// as it was). Throws UsageError naming the first parameter that
/// is missing or has another shape (the checkpoint belongs to another model or partition), and for unknown names
/// left over in `loaded`.
void restore(const NamedTensors& loaded, const NamedTensors& params, torch::optim::AdamW* optimizer);

}  // namespace twobp::checkpoint
