// Hugging Face Llama checkpoints: config.json in both transformers forms and its refusals, the name map against
// the modules' own names and shapes, rope scaling against its formula, loading chunks (one file, shards, dtype
// conversion, every mismatch refused), and import -> export giving back the same bytes. The comparison of what
// the imported model computes with transformers itself is tests/models/hf_compare.py.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/temp_files.h"
#include "twobp/checkpoint/safetensors.h"
#include "twobp/error.h"
#include "twobp/models/hf_llama.h"
#include "twobp/models/llama.h"
#include "twobp/runtime/training_state.h"

namespace twobp::testing {
namespace hf_llama_cases {

namespace ck = twobp::checkpoint;
namespace llm = twobp::models;
using json = nlohmann::json;

// transformers 5's config.json of a small Llama (LlamaConfig.save_pretrained, plus architectures).
json v5_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 4, "hidden_act": "silu", "hidden_size": 16, "initializer_range": 0.02,
    "intermediate_size": 24, "max_position_embeddings": 256, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": null,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 64, "rope_theta": 500000.0, "rope_type": "llama3"},
    "tie_word_embeddings": false, "transformers_version": "5.25.0", "use_cache": true, "vocab_size": 32})");
}

llm::LlamaConfig small_config() { return llm::parse_hf_llama_config(v5_config().dump()); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct TempDir {
  std::string path = make_temp_dir("hf_llama");
  ~TempDir() { remove_tree(path); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

TEST(HfLlamaConfig, ReadsBothTransformersForms) {
  const llm::LlamaConfig c = small_config();
  EXPECT_EQ(c.dim, 16);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.ffn_dim, 24);
  EXPECT_EQ(c.vocab_size, 32);
  EXPECT_EQ(c.max_seq_len, 256);
  EXPECT_EQ(c.norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.rope_scaling.type, llm::RopeScalingType::kLlama3);
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 64);

  // transformers 4.x: rope_theta + rope_scaling ("type" the older key), defaults for what is absent.
  json v4 = v5_config();
  v4.erase("rope_parameters");
  v4.erase("num_key_value_heads");
  v4.erase("rms_norm_eps");
  v4.erase("architectures");
  v4["rope_theta"] = 1000;
  v4["rope_scaling"] = {{"type", "linear"}, {"factor", 2}};
  const llm::LlamaConfig c4 = llm::parse_hf_llama_config(v4.dump());
  EXPECT_EQ(c4.n_kv_heads, 4);
  EXPECT_EQ(c4.norm_eps, 1e-6);  // transformers' default
  EXPECT_EQ(c4.rope_theta, 1000.0);
  EXPECT_EQ(c4.rope_scaling.type, llm::RopeScalingType::kLinear);
  EXPECT_EQ(c4.rope_scaling.factor, 2.0);
  v4["rope_scaling"] = nullptr;
  EXPECT_EQ(llm::parse_hf_llama_config(v4.dump()).rope_scaling.type, llm::RopeScalingType::kNone);
  // llama3 without original_max_position_embeddings: max_position_embeddings, as transformers standardises it.
  json v5 = v5_config();
  v5["rope_parameters"].erase("original_max_position_embeddings");
  EXPECT_EQ(llm::parse_hf_llama_config(v5.dump()).rope_scaling.original_max_position_embeddings, 256);
}

TEST(HfLlamaConfig, RefusesWhatTwobpDoesNotRun) {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"architecture", [](json& j) { j["architectures"] = {"MistralForCausalLM"}; },
       {"MistralForCausalLM", "LlamaForCausalLM"}},
      {"model type", [](json& j) { j["model_type"] = "qwen2"; }, {"\"model_type\"", "qwen2", "llama"}},
      {"no type at all", [](json& j) { j.erase("architectures"), j.erase("model_type"); }, {"architectures"}},
      {"activation", [](json& j) { j["hidden_act"] = "gelu"; }, {"\"hidden_act\"", "gelu", "silu"}},
      {"attention bias", [](json& j) { j["attention_bias"] = true; }, {"\"attention_bias\"", "no biases"}},
      {"mlp bias", [](json& j) { j["mlp_bias"] = true; }, {"\"mlp_bias\"", "no biases"}},
      {"dropout", [](json& j) { j["attention_dropout"] = 0.1; }, {"\"attention_dropout\"", "0.1"}},
      {"head_dim", [](json& j) { j["head_dim"] = 8; }, {"head_dim 8", "= 4"}},
      {"partial rotary", [](json& j) { j["partial_rotary_factor"] = 0.5; }, {"partial_rotary_factor", "0.5"}},
      {"rope type", [](json& j) { j["rope_parameters"]["rope_type"] = "yarn"; }, {"'yarn'", "not supported"}},
      {"two rope forms", [](json& j) { j["rope_scaling"] = {{"type", "linear"}, {"factor", 2}}; },
       {"both \"rope_parameters\" and \"rope_scaling\""}},
      {"llama3 incomplete", [](json& j) { j["rope_parameters"].erase("low_freq_factor"); },
       {"'llama3'", "\"low_freq_factor\""}},
      {"llama3 inverted", [](json& j) { j["rope_parameters"]["low_freq_factor"] = 8.0; },
       {"low_freq_factor < high_freq_factor"}},
      {"missing size", [](json& j) { j.erase("hidden_size"); }, {"no \"hidden_size\""}},
      {"mistyped size", [](json& j) { j["num_hidden_layers"] = "2"; }, {"\"num_hidden_layers\"", "positive integer"}},
      {"heads", [](json& j) { j["num_key_value_heads"] = 3; }, {"not divisible by n_kv_heads 3"}},
      {"tie", [](json& j) { j["tie_word_embeddings"] = "yes"; }, {"\"tie_word_embeddings\"", "true or false"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    json j = v5_config();
    c.edit(j);
    std::vector<std::string> words = c.words;
    words.push_back("my/config.json");
    expect_error([&] { llm::parse_hf_llama_config(j.dump(), "my/config.json"); }, words);
  }
  expect_error([] { llm::parse_hf_llama_config("{\"hidden_size\": ", "x.json"); }, {"x.json", "not valid JSON"});
  expect_error<IOError>([] { llm::read_hf_llama_config("/nonexistent/dir"); }, {"/nonexistent/dir"});
}

TEST(HfLlamaConfig, WrittenConfigReadsBackAndKeepsOtherKeys) {
  TempDir dir;
  for (const auto type : {llm::RopeScalingType::kNone, llm::RopeScalingType::kLinear, llm::RopeScalingType::kLlama3}) {
    llm::LlamaConfig c = small_config();
    c.rope_scaling.type = type;
    c.tie_embeddings = type == llm::RopeScalingType::kLinear;
    const std::string text = llm::hf_llama_config_json(c, v5_config().dump(), at::kBFloat16);
    const json j = json::parse(text);
    EXPECT_EQ(j["bos_token_id"], 1) << "the base's keys are kept";
    EXPECT_FALSE(j.contains("rope_parameters")) << "written in the 4.x form only";
    EXPECT_EQ(j["torch_dtype"], "bfloat16");
    const llm::LlamaConfig back = llm::parse_hf_llama_config(text);
    EXPECT_EQ(back.dim, c.dim);
    EXPECT_EQ(back.n_kv_heads, c.n_kv_heads);
    EXPECT_EQ(back.norm_eps, c.norm_eps);
    EXPECT_EQ(back.rope_theta, c.rope_theta);
    EXPECT_EQ(back.tie_embeddings, c.tie_embeddings);
    EXPECT_EQ(back.rope_scaling.type, type);
    if (type != llm::RopeScalingType::kNone) EXPECT_EQ(back.rope_scaling.factor, c.rope_scaling.factor);
  }
  EXPECT_EQ(llm::parse_rope_scaling_type("llama3"), llm::RopeScalingType::kLlama3);
  expect_error([] { llm::parse_rope_scaling_type("yarn"); }, {"'yarn'", "none, linear, llama3"});
}

TEST(HfLlamaNames, MapMatchesTheModulesNamesAndShapes) {
  llm::LlamaConfig c = small_config();
  const auto tensors = llm::hf_llama_tensors(c);
  llm::LlamaChunk whole(c, llm::make_partition(c, 1, 16).chunks[0]);
  const ck::NamedTensors params = ck::module_tensors(*whole);
  ASSERT_EQ(tensors.size(), params.size());
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, p] : params) shapes[name] = p.sizes().vec();
  for (const auto& t : tensors) {
    ASSERT_EQ(shapes.count(t.name), 1u) << t.name;
    EXPECT_EQ(shapes[t.name], t.shape) << t.name;
    EXPECT_EQ(llm::hf_llama_name(t.name), t.hf_name);
    EXPECT_EQ(llm::twobp_llama_name(t.hf_name), t.name);
  }
  // y = W2 (silu(W1 m) ⊙ W3 m): W1 is the gate, W3 the up projection, W2 down.
  EXPECT_EQ(llm::hf_llama_name("layers.1.w1.weight"), "model.layers.1.mlp.gate_proj.weight");
  EXPECT_EQ(llm::hf_llama_name("layers.1.w3.weight"), "model.layers.1.mlp.up_proj.weight");
  EXPECT_EQ(llm::hf_llama_name("layers.1.w2.weight"), "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(llm::hf_llama_name("layers.0.attn_norm.weight"), "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(llm::hf_llama_name("head.weight"), "lm_head.weight");
  EXPECT_EQ(llm::twobp_llama_name("model.layers.0.self_attn.q_proj.bias"), std::nullopt);
  EXPECT_EQ(llm::twobp_llama_name("model.layers.01.self_attn.q_proj.weight"), std::nullopt);
  expect_error([] { llm::hf_llama_name("layers.x.wq.weight"); }, {"'layers.x.wq.weight'", "not a parameter name"});
  c.tie_embeddings = true;
  EXPECT_EQ(llm::hf_llama_tensors(c).size(), tensors.size() - 1) << "tied: no lm_head.weight";
}

// rope_inverse_frequencies against the formula in double: each frequency in its band.
TEST(RopeScaling, FrequenciesFollowTheirFormula) {
  llm::LlamaConfig c = small_config();  // head_dim 4: frequencies theta^0, theta^-1/2
  c.n_heads = 1;
  c.n_kv_heads = 1;  // head_dim 16: 8 frequencies
  c.rope_theta = 10000.0;
  c.rope_scaling = {llm::RopeScalingType::kLlama3, 8.0, 1.0, 8.0, 2048};
  const at::Tensor plain = twobp::nn::rotary_inverse_frequencies(16, 1e4);
  const at::Tensor got = llm::rope_inverse_frequencies(c);
  ASSERT_EQ(got.scalar_type(), at::kFloat);
  ASSERT_EQ(got.numel(), 8);
  int bands[3] = {0, 0, 0};
  for (int i = 0; i < 8; ++i) {
    const double f = std::pow(1e4, -i / 8.0), w = 2 * M_PI / f;
    EXPECT_NEAR(plain[i].item<double>() / f, 1.0, 1e-6) << i;
    double want = f;
    if (w > 2048.0) {
      want = f / 8, ++bands[0];
    } else if (w >= 2048.0 / 8) {
      const double s = (2048.0 / w - 1.0) / (8.0 - 1.0);
      want = (1 - s) * f / 8 + s * f, ++bands[1];
    } else {
      ++bands[2];
    }
    EXPECT_NEAR(got[i].item<double>() / want, 1.0, 1e-6) << i;
  }
  EXPECT_EQ(bands[0], 2);
  EXPECT_EQ(bands[1], 2);
  EXPECT_EQ(bands[2], 4);
  c.rope_scaling = {llm::RopeScalingType::kLinear, 4.0};
  EXPECT_TRUE(torch::equal(llm::rope_inverse_frequencies(c), plain / 4.0));
  c.rope_scaling = {};
  EXPECT_TRUE(torch::equal(llm::rope_inverse_frequencies(c), plain));
  // A chunk's rotary tables use them.
  c.rope_scaling = {llm::RopeScalingType::kLinear, 4.0};
  llm::LlamaChunk chunk(c, llm::make_partition(c, 1, 16).chunks[0]);
  EXPECT_TRUE(torch::equal(chunk->blocks[0]->rotary->inverse_frequencies(), plain / 4.0));
}

// A transformers-named checkpoint of `config` with random weights (in `dtype`).
ck::NamedTensors hf_tensors(const llm::LlamaConfig& c, at::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  ck::NamedTensors out;
  for (const auto& t : llm::hf_llama_tensors(c)) out.emplace_back(t.hf_name, torch::randn(t.shape).to(dtype));
  return out;
}

void expect_loaded(const llm::LlamaChunk& chunk, const ck::NamedTensors& file) {
  std::map<std::string, at::Tensor> by_name(file.begin(), file.end());
  for (const auto& [name, p] : ck::module_tensors(*chunk)) {
    EXPECT_TRUE(torch::equal(p, by_name.at(llm::hf_llama_name(name)).to(p.scalar_type()))) << name;
  }
}

TEST(HfLlamaLoad, ChunksReadTheirOwnTensorsFromFilesAndShards) {
  TempDir dir;
  const llm::LlamaConfig c = small_config();
  const ck::NamedTensors file = hf_tensors(c, at::kBFloat16, 1);
  ck::SafetensorsSaveOptions o;
  o.durable = false;
  ck::save_safetensors(dir / "one", file, o);
  o.max_shard_bytes = 2000;
  ASSERT_GT(ck::save_safetensors(dir / "sharded", file, o).size(), 3u);  // shards and their index
  for (const std::string& path : {dir / "one", dir / "sharded", dir / "one/model.safetensors"}) {
    SCOPED_TRACE(path);
    const llm::Partition partition = llm::make_partition(c, 3, 16, "0,1,1");
    for (const llm::ChunkSpec& spec : partition.chunks) {
      llm::LlamaChunk chunk(c, spec, 5);  // float32: the bfloat16 file into float32 weights, exactly
      llm::load_hf_llama(path, *chunk);
      expect_loaded(chunk, file);
    }
  }
}

TEST(HfLlamaLoad, RefusesCheckpointsThatDisagreeWithTheConfig) {
  TempDir dir;
  const llm::LlamaConfig c = small_config();
  llm::LlamaChunk chunk(c, llm::make_partition(c, 1, 16).chunks[0]);
  const auto save = [&](const ck::NamedTensors& tensors) {
    ck::write_safetensors(dir / "model.safetensors", tensors, {}, false);
  };
  const std::string file = dir / "model.safetensors";
  ck::NamedTensors missing = hf_tensors(c, at::kFloat, 2);
  missing.erase(missing.begin() + 6);  // layer 0's up_proj (embedding, then q, k, v, o, gate, up, ...)
  save(missing);
  expect_error([&] { llm::load_hf_llama(dir.path, *chunk); },
               {file, "no tensor 'model.layers.0.mlp.up_proj.weight'", "layers.0.w3.weight", "2 layers"});
  ck::NamedTensors shaped = hf_tensors(c, at::kFloat, 2);
  shaped[3].second = torch::zeros({16, 16});  // v_proj of 4 heads where the config has 2 kv heads
  save(shaped);
  expect_error([&] { llm::load_hf_llama(dir.path, *chunk); },
               {file, "'model.layers.0.self_attn.v_proj.weight'", "[16, 16]", "[8, 16]", "disagree"});
  for (const std::string extra : {"model.layers.2.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"}) {
    ck::NamedTensors more = hf_tensors(c, at::kFloat, 2);
    more.emplace_back(extra, torch::zeros({16}));
    save(more);
    expect_error([&] { llm::load_hf_llama(dir.path, *chunk); }, {file, "'" + extra + "'", "not part of the model"});
  }
  ck::NamedTensors ints = hf_tensors(c, at::kFloat, 2);
  ints[0].second = ints[0].second.to(at::kInt);
  save(ints);
  expect_error([&] { llm::load_hf_llama(dir.path, *chunk); }, {file, "model.embed_tokens.weight", "Int"});
  // Derived buffers of older checkpoints are ignored.
  ck::NamedTensors old = hf_tensors(c, at::kFloat, 2);
  old.emplace_back("model.layers.1.self_attn.rotary_emb.inv_freq", torch::ones({2}));
  save(old);
  llm::load_hf_llama(dir.path, *chunk);
  // The destination side: a name the model lacks, a wrong shape.
  expect_error([&] { llm::load_hf_llama(dir.path, c, {{"optim.embed.weight.exp_avg", torch::zeros({1})}}); },
               {"'optim.embed.weight.exp_avg'", "not a parameter"});
  expect_error([&] { llm::load_hf_llama(dir.path, c, {{"norm.weight", torch::zeros({3})}}); },
               {"'norm.weight'", "[3]", "[16]"});
}

TEST(HfLlamaLoad, TiedEmbeddingsLoadTheHeadFromTheEmbedding) {
  TempDir dir;
  llm::LlamaConfig c = small_config();
  c.tie_embeddings = true;
  llm::LlamaChunk chunk(c, llm::make_partition(c, 1, 16).chunks[0]);
  ck::NamedTensors file = hf_tensors(c, at::kFloat, 4);
  ck::write_safetensors(dir / "model.safetensors", file, {}, false);
  llm::load_hf_llama(dir.path, *chunk);
  expect_loaded(chunk, file);
  EXPECT_TRUE(torch::equal(chunk->head->weight, file[0].second));
  // A head.weight of its own (a tie spanning chunks) loads the embedding too.
  at::Tensor head = torch::zeros({32, 16});
  llm::load_hf_llama(dir.path, c, {{"head.weight", head}});
  EXPECT_TRUE(torch::equal(head, file[0].second));
  // lm_head.weight stored as well: accepted when equal to the embedding, refused otherwise.
  file.emplace_back("lm_head.weight", file[0].second.clone());
  ck::write_safetensors(dir / "model.safetensors", file, {}, false);
  llm::load_hf_llama(dir.path, *chunk);
  file.back().second += 1;
  ck::write_safetensors(dir / "model.safetensors", file, {}, false);
  expect_error([&] { llm::load_hf_llama(dir.path, *chunk); }, {"lm_head.weight differs", "tie_word_embeddings"});
}

// Import -> export gives back the checkpoint byte for byte: float32 and bfloat16 files (through float32 chunks),
// one file and shards with their index.
TEST(HfLlamaExport, ImportThenExportIsBitwiseTheSame) {
  TempDir dir;
  const llm::LlamaConfig c = small_config();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const uint64_t shard : {uint64_t{0}, uint64_t{3000}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " shards of " + std::to_string(shard));
      const std::string in = dir / "in", out = dir / "out";
      ck::SafetensorsSaveOptions so;
      so.metadata = {{"format", "pt"}};
      so.max_shard_bytes = shard;
      so.durable = false;
      const std::vector<std::string> files = ck::save_safetensors(in, hf_tensors(c, dtype, 6), so);
      ck::NamedTensors gathered;  // every chunk's tensors, as the ranks of a pipeline would gather them
      for (const llm::ChunkSpec& spec : llm::make_partition(c, 3, 16).chunks) {
        llm::LlamaChunk chunk(c, spec);
        llm::load_hf_llama(in, *chunk);
        for (const auto& t : ck::module_tensors(*chunk)) gathered.push_back(t);
      }
      llm::HfExportOptions o;
      o.dtype = dtype;
      o.max_shard_bytes = shard;
      o.durable = false;
      std::vector<std::string> written = llm::export_hf_llama(out, c, gathered, o);
      ASSERT_EQ(written.back(), "config.json");
      written.pop_back();
      EXPECT_EQ(written, files);
      for (const std::string& f : files) EXPECT_EQ(slurp(out + "/" + f), slurp(in + "/" + f)) << f;
      EXPECT_EQ(llm::read_hf_llama_config(out).rope_scaling.type, c.rope_scaling.type);
      remove_tree(in);
      remove_tree(out);
    }
  }
}

TEST(HfLlamaExport, RefusesIncompleteOrForeignTensorSets) {
  TempDir dir;
  llm::LlamaConfig c = small_config();
  llm::LlamaChunk chunk(c, llm::make_partition(c, 1, 16).chunks[0]);
  const ck::NamedTensors all = ck::module_tensors(*chunk);
  ck::NamedTensors some(all.begin() + 1, all.end());
  expect_error([&] { llm::export_hf_llama(dir.path, c, some); }, {"no 'embed.weight'", "gathered"});
  ck::NamedTensors more = all;
  more.emplace_back("optim.norm.weight.exp_avg", torch::zeros({16}));
  expect_error([&] { llm::export_hf_llama(dir.path, c, more); }, {"'optim.norm.weight.exp_avg'", "not a parameter"});
  ck::NamedTensors twice = all;
  twice.push_back(all[0]);
  expect_error([&] { llm::export_hf_llama(dir.path, c, twice); }, {"'embed.weight' is given twice"});
  ck::NamedTensors shaped = all;
  shaped.back().second = torch::zeros({3});
  expect_error([&] { llm::export_hf_llama(dir.path, c, shaped); }, {"'head.weight'", "[3]", "[32, 16]"});
  EXPECT_FALSE(file_exists(dir / "model.safetensors")) << "nothing written on a refusal";
  c.tie_embeddings = true;
  ck::NamedTensors tied(all.begin(), all.end());  // head.weight differs from embed.weight
  expect_error([&] { llm::export_hf_llama(dir.path, c, tied); }, {"ties the embeddings", "head.weight differs"});
}

}  // namespace hf_llama_cases
}  // namespace twobp::testing
