#include "twobp/models/hf_llama.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include <fmt/ranges.h>

#include "twobp/checkpoint/safetensors.h"
#include "twobp/error.h"
#include "twobp/files.h"
#include "util/check.h"

namespace twobp::models {

namespace {
// Helpers in a namespace of their own: this file is compiled in one unity group with the other models.
namespace hf {

using json = nlohmann::json;

// One layer's tensors, in transformers' order: twobp suffix, transformers suffix.
struct LayerName {
  const char* twobp;
  const char* hf;
};
constexpr LayerName kLayerNames[] = {
    {"wq.weight", "self_attn.q_proj.weight"}, {"wk.weight", "self_attn.k_proj.weight"},
    {"wv.weight", "self_attn.v_proj.weight"}, {"wo.weight", "self_attn.o_proj.weight"},
    {"w1.weight", "mlp.gate_proj.weight"},    {"w3.weight", "mlp.up_proj.weight"},
    {"w2.weight", "mlp.down_proj.weight"},    {"attn_norm.weight", "input_layernorm.weight"},
    {"mlp_norm.weight", "post_attention_layernorm.weight"},
};
constexpr const char* kEmbed = "embed.weight";
constexpr const char* kHfEmbed = "model.embed_tokens.weight";
constexpr const char* kHead = "head.weight";
constexpr const char* kHfHead = "lm_head.weight";
constexpr const char* kNorm = "norm.weight";
constexpr const char* kHfNorm = "model.norm.weight";

bool starts_with(const std::string& s, std::string_view prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// "<prefix><i>.<rest>" -> (i, rest); nullopt when `name` has another form.
std::optional<std::pair<int64_t, std::string>> split_layer(const std::string& name, std::string_view prefix) {
  if (!starts_with(name, prefix)) return std::nullopt;
  const char* begin = name.data() + prefix.size();
  const char* end = name.data() + name.size();
  int64_t index = -1;
  const auto [p, ec] = std::from_chars(begin, end, index);
  if (ec != std::errc() || p == begin || p == end || *p != '.' || index < 0 || (*begin == '0' && p - begin > 1)) {
    return std::nullopt;
  }
  return std::make_pair(index, std::string(p + 1, end));
}

std::vector<int64_t> layer_shape(const LlamaConfig& c, std::string_view twobp) {
  const int64_t d = c.dim, q = c.n_heads * c.head_dim(), kv = c.kv_dim(), f = c.ffn_dim;
  if (twobp == "wq.weight") return {q, d};
  if (twobp == "wk.weight" || twobp == "wv.weight") return {kv, d};
  if (twobp == "wo.weight") return {d, q};
  if (twobp == "w1.weight" || twobp == "w3.weight") return {f, d};
  if (twobp == "w2.weight") return {d, f};
  return {d};  // the norms
}

std::string shape_string(c10::IntArrayRef shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// ---- config.json ----

// Typed access to config.json's keys, every refusal naming the file and the key.
struct ConfigReader {
  const json& j;
  const std::string& source;

  bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }
  int64_t size(const char* key) const {
    TWOBP_CHECK(has(key), UsageError, "{}: no \"{}\" (a LlamaForCausalLM config.json has it)", source, key);
    return positive(key, j[key]);
  }
  int64_t positive(const char* key, const json& v) const {
    TWOBP_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, UsageError,
                "{}: \"{}\" must be a positive integer, got {}", source, key, v.dump());
    return v.get<int64_t>();
  }
  double number(const char* key, const json& v) const {
    TWOBP_CHECK(v.is_number(), UsageError, "{}: \"{}\" must be a number, got {}", source, key, v.dump());
    return v.get<double>();
  }
  double number_or(const char* key, double fallback) const { return has(key) ? number(key, j[key]) : fallback; }
  void require(const char* key, const json& expected, const std::string& why) const {
    TWOBP_CHECK(!has(key) || j[key] == expected, UsageError, "{}: \"{}\" is {}; twobp needs {} ({})", source, key,
                j[key].dump(), expected.dump(), why);
  }
};

void check_architecture(const ConfigReader& r) {
  if (r.has("architectures")) {
    const json& a = r.j["architectures"];
    TWOBP_CHECK(a.is_array() && std::find(a.begin(), a.end(), json("LlamaForCausalLM")) != a.end(), UsageError,
                "{}: architectures {} has no \"LlamaForCausalLM\", the one architecture twobp imports", r.source,
                a.dump());
  }
  TWOBP_CHECK(r.has("architectures") || r.has("model_type"), UsageError,
              "{}: neither \"architectures\" nor \"model_type\": not a transformers model config", r.source);
  r.require("model_type", "llama", "the Llama architecture");
  r.require("hidden_act", "silu", "twobp's MLP is SwiGLU with silu");
  r.require("attention_bias", false, "twobp's projections have no biases");
  r.require("mlp_bias", false, "twobp's projections have no biases");
  TWOBP_CHECK(!r.has("attention_dropout") || r.number("attention_dropout", r.j["attention_dropout"]) == 0.0,
              UsageError, "{}: \"attention_dropout\" is {}; twobp's attention has no dropout (set it to 0.0 to "
              "train without)", r.source, r.j["attention_dropout"].dump());
  TWOBP_CHECK(r.number_or("partial_rotary_factor", 1.0) == 1.0, UsageError,
              "{}: \"partial_rotary_factor\" is {}; twobp rotates the whole head (1.0)", r.source,
              r.j["partial_rotary_factor"].dump());
}

// The rope settings: "rope_parameters" (transformers 5) or "rope_theta" + "rope_scaling" (4.x).
void read_rope(const ConfigReader& r, LlamaConfig& c) {
  TWOBP_CHECK(!(r.has("rope_parameters") && r.has("rope_scaling")), UsageError,
              "{}: both \"rope_parameters\" and \"rope_scaling\": keep one", r.source);
  const json none = json::object();
  const json& p = r.has("rope_parameters") ? r.j["rope_parameters"] : r.has("rope_scaling") ? r.j["rope_scaling"]
                                                                                             : none;
  const char* key = r.has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  TWOBP_CHECK(p.is_object(), UsageError, "{}: \"{}\" must be an object, got {}", r.source, key, p.dump());
  const ConfigReader pr{p, r.source};
  c.rope_theta = pr.has("rope_theta") ? pr.number("rope_theta", p["rope_theta"]) : r.number_or("rope_theta", 1e4);
  TWOBP_CHECK(pr.number_or("partial_rotary_factor", 1.0) == 1.0, UsageError,
              "{}: \"{}\" has partial_rotary_factor {}; twobp rotates the whole head (1.0)", r.source, key,
              p["partial_rotary_factor"].dump());
  const json& type_json = pr.has("rope_type") ? p["rope_type"] : pr.has("type") ? p["type"] : json("default");
  TWOBP_CHECK(type_json.is_string(), UsageError, "{}: \"{}\" has rope type {}, not a name", r.source, key,
              type_json.dump());
  const std::string type = type_json.get<std::string>();
  RopeScaling& s = c.rope_scaling;
  const auto need = [&](const char* field) {
    TWOBP_CHECK(pr.has(field), UsageError, "{}: \"{}\" of rope type '{}' has no \"{}\"", r.source, key, type, field);
    return pr.number(field, p[field]);
  };
  if (type == "default") {
    s = RopeScaling{};
  } else if (type == "linear") {
    s.type = RopeScalingType::kLinear;
    s.factor = need("factor");
  } else if (type == "llama3") {
    s.type = RopeScalingType::kLlama3;
    s.factor = need("factor");
    s.low_freq_factor = need("low_freq_factor");
    s.high_freq_factor = need("high_freq_factor");
    s.original_max_position_embeddings = pr.has("original_max_position_embeddings")
                                             ? pr.positive("original_max_position_embeddings",
                                                           p["original_max_position_embeddings"])
                                             : c.max_seq_len;
  } else {
    twobp::detail::raise<UsageError>("{}: rope type '{}' in \"{}\" is not supported (twobp has default, linear and "
                                     "llama3)", r.source, type, key);
  }
}

// ---- Checkpoint checks ----

// The checkpoint against the model of `config`, headers only (see load_hf_llama's rule).
void check_checkpoint(const checkpoint::SafetensorsCheckpoint& ck, const LlamaConfig& c,
                      const std::vector<HfLlamaTensor>& model) {
  std::set<std::string> expected;
  for (const HfLlamaTensor& t : model) {
    expected.insert(t.hf_name);
    TWOBP_CHECK(ck.contains(t.hf_name), UsageError,
                "hf checkpoint {}: no tensor '{}' (twobp's {}), which the config's model ({} layers) has", ck.path(),
                t.hf_name, t.name, c.n_layers);
    const checkpoint::SafetensorsEntry& e = ck.entry(t.hf_name);
    TWOBP_CHECK(e.shape == t.shape, UsageError,
                "hf checkpoint {}: tensor '{}' has shape {}, the config gives {} (twobp's {}): the weights and "
                "config.json disagree", ck.file_of(t.hf_name), t.hf_name, shape_string(e.shape),
                shape_string(t.shape), t.name);
    TWOBP_CHECK(at::isFloatingType(e.dtype), UsageError,
                "hf checkpoint {}: tensor '{}' is {}, not a floating-point weight", ck.file_of(t.hf_name), t.hf_name,
                c10::toString(e.dtype));
  }
  for (const std::string& name : ck.names()) {
    if (expected.count(name) > 0) continue;
    const auto layer = split_layer(name, "model.layers.");
    if (layer && layer->second == "self_attn.rotary_emb.inv_freq") continue;  // derived; older files stored it
    if (c.tie_embeddings && name == kHfHead) continue;  // compared with the embedding where either is loaded
    twobp::detail::raise<UsageError>(
        "hf checkpoint {}: tensor '{}' is not part of the model config.json describes ({} layers, no biases{}): "
        "the weights and config.json disagree", ck.file_of(name), name, c.n_layers,
        c.tie_embeddings ? ", tied embeddings" : "");
  }
}

}  // namespace hf
}  // namespace

// ---- config.json ----

LlamaConfig parse_hf_llama_config(const std::string& text, const std::string& source) {
  hf::json j;
  try {
    j = hf::json::parse(text);
  } catch (const hf::json::exception& e) {
    throw UsageError(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  TWOBP_CHECK(j.is_object(), UsageError, "{}: a config.json is a JSON object, got {}", source, j.type_name());
  const hf::ConfigReader r{j, source};
  hf::check_architecture(r);
  LlamaConfig c;
  c.name = "hf:" + source;
  c.dim = r.size("hidden_size");
  c.n_layers = r.size("num_hidden_layers");
  c.n_heads = r.size("num_attention_heads");
  c.n_kv_heads = r.has("num_key_value_heads") ? r.size("num_key_value_heads") : c.n_heads;
  c.ffn_dim = r.size("intermediate_size");
  c.vocab_size = r.size("vocab_size");
  c.max_seq_len = r.has("max_position_embeddings") ? r.size("max_position_embeddings") : 2048;
  c.norm_eps = r.number_or("rms_norm_eps", 1e-6);
  if (r.has("tie_word_embeddings")) {
    TWOBP_CHECK(j["tie_word_embeddings"].is_boolean(), UsageError, "{}: \"tie_word_embeddings\" must be true or "
                "false, got {}", source, j["tie_word_embeddings"].dump());
    c.tie_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  TWOBP_CHECK(c.dim % c.n_heads == 0, UsageError, "{}: hidden_size {} is not divisible by num_attention_heads {}",
              source, c.dim, c.n_heads);
  if (r.has("head_dim")) {
    TWOBP_CHECK(r.size("head_dim") == c.dim / c.n_heads, UsageError,
                "{}: head_dim {} differs from hidden_size / num_attention_heads = {}; twobp's heads split the hidden "
                "size", source, j["head_dim"].dump(), c.dim / c.n_heads);
  }
  hf::read_rope(r, c);
  c.validate();
  return c;
}

LlamaConfig read_hf_llama_config(const std::string& path) {
  struct stat st;
  const bool dir = ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  const std::string file = dir ? (path.back() == '/' ? path : path + "/") + "config.json" : path;
  std::ifstream in(file, std::ios::binary);
  TWOBP_CHECK(in.is_open(), IOError, "cannot open {}: {}", file, std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TWOBP_CHECK(!in.bad(), IOError, "reading {} failed", file);
  return parse_hf_llama_config(text, file);
}

std::string hf_llama_config_json(const LlamaConfig& c, const std::string& base, at::ScalarType dtype) {
  c.validate();
  hf::json j = hf::json::object();
  if (!base.empty()) {
    try {
      j = hf::json::parse(base);
    } catch (const hf::json::exception& e) {
      throw UsageError(fmt::format("hf_llama_config_json: the base config.json is not valid JSON: {}", e.what()));
    }
    TWOBP_CHECK(j.is_object(), UsageError, "hf_llama_config_json: the base config.json is not a JSON object");
  }
  j.erase("rope_parameters");  // written in the 4.x form below, which both transformers 4 and 5 read
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = c.dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["head_dim"] = c.head_dim();
  j["intermediate_size"] = c.ffn_dim;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_seq_len;
  j["rms_norm_eps"] = c.norm_eps;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["rope_theta"] = c.rope_theta;
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScalingType::kNone) {
    j["rope_scaling"] = nullptr;
  } else if (s.type == RopeScalingType::kLinear) {
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", s.factor}};
  } else {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", s.factor},
                         {"low_freq_factor", s.low_freq_factor},
                         {"high_freq_factor", s.high_freq_factor},
                         {"original_max_position_embeddings", s.original_max_position_embeddings}};
  }
  const std::string type = c10::toString(dtype);
  const std::map<std::string, std::string> torch_names = {
      {"Float", "float32"}, {"BFloat16", "bfloat16"}, {"Half", "float16"}, {"Double", "float64"}};
  TWOBP_CHECK(torch_names.count(type) > 0, UsageError, "hf_llama_config_json: dtype {} is not a weight dtype "
              "(float32, bfloat16, float16, float64)", type);
  j["torch_dtype"] = torch_names.at(type);
  if (j.contains("dtype")) j["dtype"] = torch_names.at(type);  // transformers 5's name for it
  return j.dump(2) + "\n";
}

// ---- Names ----

std::vector<HfLlamaTensor> hf_llama_tensors(const LlamaConfig& c) {
  std::vector<HfLlamaTensor> out;
  out.push_back({hf::kEmbed, hf::kHfEmbed, {c.vocab_size, c.dim}});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    for (const auto& n : hf::kLayerNames) {
      out.push_back({fmt::format("layers.{}.{}", i, n.twobp), fmt::format("model.layers.{}.{}", i, n.hf),
                     hf::layer_shape(c, n.twobp)});
    }
  }
  out.push_back({hf::kNorm, hf::kHfNorm, {c.dim}});
  if (!c.tie_embeddings) out.push_back({hf::kHead, hf::kHfHead, {c.vocab_size, c.dim}});
  return out;
}

std::string hf_llama_name(const std::string& name) {
  if (name == hf::kEmbed) return hf::kHfEmbed;
  if (name == hf::kNorm) return hf::kHfNorm;
  if (name == hf::kHead) return hf::kHfHead;
  if (const auto layer = hf::split_layer(name, "layers.")) {
    for (const auto& n : hf::kLayerNames) {
      if (layer->second == n.twobp) return fmt::format("model.layers.{}.{}", layer->first, n.hf);
    }
  }
  twobp::detail::raise<UsageError>("'{}' is not a parameter name of twobp's Llama (embed.weight, "
                                   "layers.<i>.<wq|wk|wv|wo|w1|w2|w3|attn_norm|mlp_norm>.weight, norm.weight, "
                                   "head.weight)", name);
}

std::optional<std::string> twobp_llama_name(const std::string& hf_name) {
  if (hf_name == hf::kHfEmbed) return std::string(hf::kEmbed);
  if (hf_name == hf::kHfNorm) return std::string(hf::kNorm);
  if (hf_name == hf::kHfHead) return std::string(hf::kHead);
  if (const auto layer = hf::split_layer(hf_name, "model.layers.")) {
    for (const auto& n : hf::kLayerNames) {
      if (layer->second == n.hf) return fmt::format("layers.{}.{}", layer->first, n.twobp);
    }
  }
  return std::nullopt;
}

// ---- Import ----

void load_hf_llama(const std::string& path, const LlamaConfig& config, const checkpoint::NamedTensors& named) {
  config.validate();
  const checkpoint::SafetensorsCheckpoint ck(path);
  const std::vector<HfLlamaTensor> model = hf_llama_tensors(config);
  hf::check_checkpoint(ck, config, model);
  std::map<std::string, const HfLlamaTensor*> by_name;
  for (const HfLlamaTensor& t : model) by_name[t.name] = &t;
  bool embedding = false;
  for (const auto& [name, dest] : named) {
    // With tied embeddings the head is the embedding (a head.weight of its own only where a tie spans chunks).
    const bool tied_head = config.tie_embeddings && name == hf::kHead;
    const auto it = by_name.find(tied_head ? std::string(hf::kEmbed) : name);
    TWOBP_CHECK(it != by_name.end(), UsageError,
                "load_hf_llama {}: '{}' is not a parameter of the model of config '{}' ({} layers{})", ck.path(),
                name, config.name, config.n_layers, config.tie_embeddings ? ", tied embeddings" : "");
    TWOBP_CHECK(dest.defined() && dest.sizes() == c10::IntArrayRef(it->second->shape), UsageError,
                "load_hf_llama {}: the destination of '{}' has shape {}, config '{}' gives {}", ck.path(), name,
                dest.defined() ? hf::shape_string(dest.sizes()) : "undefined", config.name,
                hf::shape_string(it->second->shape));
    ck.read_into(it->second->hf_name, dest);
    embedding = embedding || it->second->name == hf::kEmbed;
  }
  if (embedding && config.tie_embeddings && ck.contains(hf::kHfHead)) {
    TWOBP_CHECK(at::equal(ck.read(hf::kHfHead), ck.read(hf::kHfEmbed)), UsageError,
                "hf checkpoint {}: config.json ties the embeddings, but lm_head.weight differs from "
                "model.embed_tokens.weight: set tie_word_embeddings to false, or drop lm_head.weight",
                ck.file_of(hf::kHfHead));
  }
}

void load_hf_llama(const std::string& path, LlamaChunkImpl& chunk) {
  load_hf_llama(path, chunk.config(), checkpoint::module_tensors(chunk));
}

// ---- Export ----

std::vector<std::string> export_hf_llama(const std::string& dir, const LlamaConfig& config,
                                         const checkpoint::NamedTensors& tensors, const HfExportOptions& o) {
  config.validate();
  std::map<std::string, at::Tensor> given;
  for (const auto& [name, t] : tensors) {
    TWOBP_CHECK(given.emplace(name, t).second, UsageError, "export_hf_llama {}: tensor '{}' is given twice", dir,
                name);
  }
  checkpoint::NamedTensors out;
  for (const HfLlamaTensor& t : hf_llama_tensors(config)) {
    const auto it = given.find(t.name);
    TWOBP_CHECK(it != given.end(), UsageError, "export_hf_llama {}: no '{}' among the {} tensors given (every "
                "rank's named tensors, gathered, are needed)", dir, t.name, tensors.size());
    TWOBP_CHECK(it->second.defined() && it->second.sizes() == c10::IntArrayRef(t.shape), UsageError,
                "export_hf_llama {}: '{}' has shape {}, config '{}' gives {}", dir, t.name,
                it->second.defined() ? hf::shape_string(it->second.sizes()) : "undefined", config.name,
                hf::shape_string(t.shape));
    out.emplace_back(t.hf_name, o.dtype ? it->second.detach().to(*o.dtype) : it->second.detach());
    given.erase(it);
  }
  if (config.tie_embeddings && given.count(hf::kHead) > 0) {
    const at::Tensor& embed = out.front().second;
    TWOBP_CHECK(at::equal(given.at(hf::kHead).detach().to(embed.device(), embed.scalar_type()), embed), UsageError,
                "export_hf_llama {}: config '{}' ties the embeddings but head.weight differs from embed.weight",
                dir, config.name);
    given.erase(hf::kHead);
  }
  TWOBP_CHECK(given.empty(), UsageError,
              "export_hf_llama {}: '{}' is not a parameter of the model of config '{}' (pass the parameters only, "
              "under twobp's global names)", dir, given.empty() ? "" : given.begin()->first, config.name);
  checkpoint::SafetensorsSaveOptions so;
  so.metadata = {{"format", "pt"}};  // what transformers writes, and what its loader expects
  so.max_shard_bytes = o.max_shard_bytes;
  so.durable = o.durable;
  std::vector<std::string> files = checkpoint::save_safetensors(dir, out, so);
  const std::string config_path = (dir.back() == '/' ? dir : dir + "/") + "config.json";
  write_file(config_path, hf_llama_config_json(config, o.base_config, out.front().second.scalar_type()),
             "export_hf_llama config", o.durable);
  files.push_back("config.json");
  return files;
}

}  // namespace twobp::models
