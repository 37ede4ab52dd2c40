// llama_pipeline and Hugging Face Llama checkpoints (twobp/models/hf_llama.h): the model of --init-from and its
// weights, and --export-hf at the end of the run.
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>

#include "example.h"
#include "twobp/error.h"
#include "twobp/models/hf_llama.h"
#include "twobp/transport/collectives.h"

namespace llama_example {
namespace {

/// The dtype --export-hf writes: --export-dtype, else the weights the run holds (its masters: float32 under
/// --dtype bf16, bfloat16 under bf16-pure).
at::ScalarType hf_export_dtype(const Plan& p) {
  if (p.args.export_dtype == "bf16") return at::kBFloat16;
  if (p.args.export_dtype == "f32") return at::kFloat;
  return p.precision == twobp::Precision::kMixedBFloat16 ? at::kFloat : twobp::compute_dtype(p.precision);
}

/// Which pipeline rank sends each tensor of `model`: the lowest holding it. Collective over `pipeline` (one sum of
/// a flag per tensor and rank), so every rank knows every tensor's sender without knowing the partition's rules.
std::vector<int> tensor_senders(const std::vector<llm::HfLlamaTensor>& model,
                                const std::map<std::string, at::Tensor>& mine, twobp::Transport& pipeline,
                                twobp::Duration timeout) {
  const int ranks = pipeline.world_size();
  std::vector<double> holds(model.size() * ranks, 0.0);
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (mine.count(model[i].name) != 0) holds[i * ranks + pipeline.rank()] = 1.0;
  }
  holds = twobp::sum_over_ranks(pipeline, holds, timeout);
  std::vector<int> senders(model.size(), -1);
  for (std::size_t i = 0; i < model.size(); ++i) {
    for (int r = ranks - 1; r >= 0; --r) {
      if (holds[i * ranks + r] > 0) senders[i] = r;
    }
    // Every parameter is in some chunk: a tensor no rank holds is a bug of the model's naming, not the user's.
    EXAMPLE_CHECK(senders[i] >= 0, twobp::Error, "--export-hf: no pipeline rank holds {} (twobp's name of {})",
                  model[i].name, model[i].hf_name);
  }
  return senders;
}

}  // namespace

std::string read_hf_config_text(const std::string& dir) {
  const std::string file = dir + "/config.json";
  std::ifstream in(file, std::ios::binary);
  EXAMPLE_CHECK(in.is_open(), twobp::IOError, "--init-from: cannot open {}: {} (a Hugging Face model directory has "
                "config.json and model.safetensors or model.safetensors.index.json)", file, std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXAMPLE_CHECK(!in.bad(), twobp::IOError, "--init-from: reading {} failed", file);
  return text;
}

std::string checkpoint_hf_config(const std::string& dir) {
  if (!ck::checkpoint_exists(dir)) return {};  // --resume's own checks say what is missing
  const ck::Manifest manifest = ck::read_manifest(dir);
  const auto it = manifest.config.find(kHfConfigKey);
  return it == manifest.config.end() ? std::string() : it->second;
}

llm::LlamaConfig hf_model_config(const Args& a, const std::string& text, const std::string& source) {
  EXAMPLE_CHECK(!a.model_given, twobp::UsageError,
                "--model {} with the Hugging Face model of {}: the model is the one its config.json describes; "
                "leave --model out", a.model, source);
  const llm::LlamaConfig c = llm::parse_hf_llama_config(text, source);
  struct Size {
    const char* option;
    int64_t given, model;
    const char* key;
  };
  const Size sizes[] = {{"--dim", a.dims.dim, c.dim, "hidden_size"},
                        {"--layers", a.dims.layers, c.n_layers, "num_hidden_layers"},
                        {"--heads", a.dims.heads, c.n_heads, "num_attention_heads"},
                        {"--kv-heads", a.dims.kv_heads, c.n_kv_heads, "num_key_value_heads"},
                        {"--ffn", a.dims.ffn, c.ffn_dim, "intermediate_size"},
                        {"--vocab", a.dims.vocab, c.vocab_size, "vocab_size"}};
  for (const Size& s : sizes) {
    EXAMPLE_CHECK(s.given == 0 || s.given == s.model, twobp::UsageError,
                  "{} {} contradicts {}, whose {} is {}: the model's sizes come from its config.json; leave {} out",
                  s.option, s.given, source, s.key, s.model, s.option);
  }
  return c;
}

void load_hf_weights(const Plan& p, const ck::NamedTensors& named, bool reports) {
  // Each rank maps the files and reads only its own tensors, converted to their dtype (bfloat16 files into float32
  // masters under --dtype bf16); the checks on the headers are alike on every rank, so all refuse a bad checkpoint.
  llm::load_hf_llama(p.args.init_from, p.config, named);
  if (reports) {
    fmt::print("initialised from {} (Hugging Face Llama: dim {}, {} layers, vocabulary {}{}): step 0, new optimizer "
               "state\n", p.args.init_from, p.config.dim, p.config.n_layers, p.config.vocab_size,
               p.config.tie_embeddings ? ", tied embeddings" : "");
  }
}

// Gathering by broadcast over the pipeline's transport, one tensor at a time: the same code for rank threads
// (Local), MPI processes and NCCL, with the collective order every transport already guarantees, no message tags to
// share with the executor's, and no filesystem the ranks must share (a per-rank file merged on rank 0 would need
// one). The cost: each tensor reaches every pipeline rank, not only rank 0 -- once, at the end of a run.
void export_hf_model(const Plan& p, const ck::NamedTensors& named, twobp::Transport& pipeline, int replica,
                     twobp::Duration timeout, Shared& shared) {
  if (replica != 0) return;  // the other replicas hold copies of replica 0's tensors
  const std::vector<llm::HfLlamaTensor> model = llm::hf_llama_tensors(p.config);  // tied: no head.weight
  const std::map<std::string, at::Tensor> mine(named.begin(), named.end());
  const std::vector<int> senders = tensor_senders(model, mine, pipeline, timeout);
  const at::ScalarType dtype = hf_export_dtype(p);
  const bool writes = pipeline.rank() == 0;
  const auto options = at::TensorOptions().dtype(dtype).device(pipeline.device());
  ck::NamedTensors gathered;
  for (std::size_t i = 0; i < model.size(); ++i) {
    const bool sends = senders[i] == pipeline.rank();
    if (senders[i] == 0 && !writes) continue;  // rank 0's own tensors need no message
    at::Tensor t =
        sends ? mine.at(model[i].name).detach().to(options).contiguous() : at::empty(model[i].shape, options);
    if (senders[i] != 0) pipeline.broadcast(t, senders[i], timeout);
    // On the host, one tensor at a time: the whole model's device memory is never needed at once.
    if (writes) gathered.emplace_back(model[i].name, t.to(at::kCPU));
  }
  if (!writes) return;
  llm::HfExportOptions o;
  o.dtype = dtype;
  o.base_config = p.hf_config;  // --init-from's other keys (token ids, generation settings) are kept
  std::vector<std::string> files = llm::export_hf_llama(p.args.export_hf, p.config, gathered, o);
  const char* dtype_name = dtype == at::kFloat ? "float32" : dtype == at::kBFloat16 ? "bfloat16" : c10::toString(dtype);
  fmt::print("Hugging Face Llama ({}, {} files) written to {}\n", dtype_name, files.size(), p.args.export_hf);
  std::lock_guard<std::mutex> lock(shared.mutex);
  shared.exported = std::move(files);
}

}  // namespace llama_example
