// What cpu_ops.cpp and step_cpu.cpp share: the C kernels' Problem structs (the C
// files', field for field), their addresses once cpu_ops.py hands them over, and the ops
// the one call per layer chains.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace specache_cpu {

struct MergeProblem {  // merge_cpu.c
  const void *rows, *row_max, *row_sum, *lowbit_out;
  const void *k[3], *v[3];
  int64_t k_stride[3][3], v_stride[3][3];
  const void *fetched_valid, *window_len;
  void *out, *lowbit_scale;
  void *p[3];
  int64_t batch, kv_heads, m, d, n[3];
  int32_t dtype[3], threads;
};

struct RankProblem {  // rank_cpu.c
  const void *weights, *scale, *p_fetched, *fetched_pos, *p_window, *window_start, *upper,
      *excluded_pos, *excluded_valid;
  void *indices, *valid;
  int64_t batch, heads, m, t, n_fetched, n_window, n_excluded, k, lower;
  int32_t s, row, max_over_heads, threads;
  const void *block_max;  // the one-op step's alone: the low-bit pass's largest weight per block
};

struct LowbitProblem {  // lowbit_cpu.c
  const void *rows, *k_packed, *v_packed, *k_scale, *k_zero, *v_scale, *v_zero, *visible_len,
      *excluded_pos, *excluded_valid;
  void *weights, *row_max, *row_sum, *out;
  int64_t batch, heads, m, d, t, k;
  int32_t bits, group, value_groups, bf16, threads;
  const void *v_mean;  // the sparse pass's alone (lowbit_sparse_cpu.c), else NULL and 0
  void *kept;
  double min_weight;
  float *block_max;  // the one-op step's alone (lowbit_pass_for_step), else NULL
};

using MergeKernel = int (*)(const MergeProblem *);
using RankKernel = int (*)(const RankProblem *);
using LowbitKernel = int (*)(const LowbitProblem *);
inline MergeKernel merge_kernel = nullptr;
inline RankKernel rank_kernel = nullptr;
inline LowbitKernel lowbit_kernel = nullptr;       // lowbit_cpu.c
inline LowbitKernel lowbit_int8_kernel = nullptr;  // lowbit_int_cpu.c, the same struct
inline LowbitKernel lowbit_sparse_kernel = nullptr;  // lowbit_sparse_cpu.c, the same struct

// The op specache_plain::`name`: the plain-PyTorch definition of specache::`name`,
// registered by cpu_ops.py, for the shapes a C kernel does not take.
template <typename Signature>
c10::TypedOperatorHandle<Signature> plain(const char *name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("specache_plain::") + name).c_str(), "")
      .typed<Signature>();
}

// The C kernels' element types: float32, bfloat16, float16.
inline int32_t dtype_code(at::ScalarType dtype) {
  return dtype == at::kFloat ? 0 : dtype == at::kBFloat16 ? 1 : 2;
}

// specache::lowbit_partial_attention (integer: its _int8 twin), in cpu_ops.cpp.
using LowbitOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
template <bool integer>
LowbitOutputs lowbit_partial_attention(
    const at::Tensor &rows_in, const at::Tensor &k_packed_in, const at::Tensor &k_scale_in,
    const at::Tensor &k_zero_in, const at::Tensor &v_packed_in, const at::Tensor &v_scale_in,
    const at::Tensor &v_zero_in, int64_t bits, int64_t group, const at::Tensor &visible_len_in,
    const at::Tensor &excluded_pos_in, const at::Tensor &excluded_valid_in);

// specache::lowbit_partial_attention_sparse, in cpu_ops.cpp: weights, row_max, row_sum, out, kept.
using SparseOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
SparseOutputs lowbit_partial_attention_sparse(
    const at::Tensor &rows, const at::Tensor &k_packed, const at::Tensor &k_scale,
    const at::Tensor &k_zero, const at::Tensor &v_packed, const at::Tensor &v_scale,
    const at::Tensor &v_zero, const at::Tensor &v_mean, int64_t bits, int64_t group,
    double min_weight, const at::Tensor &visible_len, const at::Tensor &excluded_pos,
    const at::Tensor &excluded_valid);

// The low-bit pass of the one-op step (arithmetic: specache.config.ARITHMETICS' index), which
// also writes each row's largest weight per block of 64 positions into `block_max` (B, Hkv, M,
// ceil(T/64)), the bound the step's rankings skip blocks by; nullopt for a shape the C kernels do
// not take. In cpu_ops.cpp.
std::optional<LowbitOutputs> lowbit_pass_for_step(
    int64_t arithmetic, const at::Tensor &rows, const at::Tensor &k_packed,
    const at::Tensor &k_scale, const at::Tensor &k_zero, const at::Tensor &v_packed,
    const at::Tensor &v_scale, const at::Tensor &v_zero, const at::Tensor *v_mean, int64_t bits,
    int64_t group, double min_weight, const at::Tensor &visible_len,
    const at::Tensor &excluded_pos, const at::Tensor &excluded_valid, float *block_max);

// Registers `impl` as the implementation of the op `ns`::`op` for CPU tensors, ahead of the Python
// one (for the process's life).
template <typename Impl>
void register_cpu(const char *ns, const char *op, Impl impl) {
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                                       c10::DispatchKey::CPU, __FILE__, __LINE__));
  libraries.back()->impl(op, impl);
}

// The size of the struct a C kernel of this type takes.
template <typename Problem>
constexpr int64_t problem_size(int (*)(const Problem *)) {
  return static_cast<int64_t>(sizeof(Problem));
}

// Keeps a C kernel's address in `slot`; the first time, registers the C++ implementation `impl` of
// the op `ns`::`op`. `problem_bytes`: the C struct's size (its problem_bytes()), which the C++ copy
// the kernel is called with must have.
template <typename Kernel, typename Impl>
void hand_over(const char *ns, Kernel &slot, int64_t address, const char *op, Impl impl,
               int64_t problem_bytes) {
  TORCH_CHECK(problem_bytes == problem_size(slot), op, ": the C kernel's Problem struct is ",
              problem_bytes, " bytes, the C++ copy ", problem_size(slot),
              "; they must agree field for field");
  const bool first = slot == nullptr;
  slot = reinterpret_cast<Kernel>(address);
  if (first) register_cpu(ns, op, impl);  // else registered already; the new address serves
}

// Registers specache::step_attention's C++ implementation (step_cpu.cpp) once the kernels
// it runs are handed over and its fallback is defined; whether it is registered.
bool enable_step_attention();

}  // namespace specache_cpu
