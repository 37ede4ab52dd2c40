// Harness of the README's library snippet (README.md, "Using the library"; tests/scripts/doc_blocks.py puts it at
// the marked line, after the snippet's own #include lines). It includes nothing itself: the snippet must compile
// with exactly the headers it shows. It declares what the snippet leaves to the reader (MyChunk, my_loss, the
// data, an optimizer) and is built and linked, not run (the snippet needs mpirun and a model worth the shapes).

namespace {

struct MyChunkImpl : torch::nn::Module {
  MyChunkImpl() : linear(register_module("linear", twobp::nn::Linear(4096, 4096))) {}
  at::Tensor forward(const at::Tensor& x) { return linear(x); }
  twobp::nn::Linear linear;
};
TORCH_MODULE(MyChunk);

at::Tensor my_loss(const at::Tensor& output, const at::Tensor& target) { return (output - target).pow(2).mean(); }

struct Optimizer {
  void step() {}
};

}  // namespace

int main(int argc, char** argv) {
  const int steps = 1;
  at::Tensor inputs;
  at::Tensor targets;
  Optimizer optimizer;
  // @snippet readme_library@
  return 0;
}
