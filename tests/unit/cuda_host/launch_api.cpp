// Calls the CUDA extension's C launch API (csrc/cuda/kernels.h) on the host, linked with the real
// csrc/cuda/logprob_entropy.cu (tests/unit/test_ops_cuda_host.py builds it with nvcc). Only calls that must return
// before any launch are made, so no GPU (and no driver) is needed:
//   launch_api workspace N V f32|bf16|f64 SM   prints "bytes B" (mppo_cuda_lse_workspace_bytes)
//   launch_api zero_rows V                       prints "partials E backward E" (launch status of an [0, V] input)
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/kernels.h"

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "workspace") == 0 && argc == 6) {
    const mppo_dtype dtype = std::strcmp(argv[4], "f64") == 0   ? MPPO_F64
                             : std::strcmp(argv[4], "bf16") == 0 ? MPPO_BF16
                                                                 : MPPO_F32;
    const size_t bytes = mppo_cuda_lse_workspace_bytes(std::strtoll(argv[2], nullptr, 10),
                                                       std::strtoll(argv[3], nullptr, 10), dtype,
                                                       static_cast<int>(std::strtol(argv[5], nullptr, 10)));
    std::printf("bytes %zu\n", bytes);
    return 0;
  }
  if (argc >= 2 && std::strcmp(argv[1], "zero_rows") == 0 && argc == 3) {
    const int64_t vocab = std::strtoll(argv[2], nullptr, 10);
    const mppo_logits in{nullptr, MPPO_F32, 0, vocab, vocab, nullptr, 0, 1.0};
    const cudaError_t partials = mppo_cuda_lse_partials(in, nullptr, nullptr, 0, 132, nullptr);
    const cudaError_t backward =
        mppo_cuda_lse_backward(in, nullptr, nullptr, nullptr, nullptr, nullptr, vocab, 132, nullptr);
    std::printf("partials %d backward %d\n", static_cast<int>(partials), static_cast<int>(backward));
    return 0;
  }
  std::fprintf(stderr, "usage: launch_api workspace N V DTYPE SM | zero_rows V\n");
  return 2;
}
