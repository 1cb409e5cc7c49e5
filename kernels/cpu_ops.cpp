// The CPU ops that a decode step calls most, dispatched in C++: specache::quantized_linear (about 150
// calls a step on SmolLM2), specache::dense_decode_attention (one per layer), and SpeCache's
// specache::lowbit_partial_attention (or its _int8 twin), specache::merge_segments and
// specache::top_positions, which specache::step_attention chains in one call per layer. Their
// Python implementations (kernels/linear_cpu.py, dense_cpu.py, lowbit_cpu.py, rank_cpu.py: `_op`)
// check the inputs, fill a ctypes
// struct and call the C kernel, about 12 us a call; this does the same in about 2.
//
// kernels/cpu_ops.py builds it at first use against the running torch's headers. Each kernel's module
// hands over its C function's address once it has built it (specache::set_cpu_kernel), and only then
// does this file register its implementation of that op for CPU tensors, ahead of the Python one;
// where this file does not build, the Python implementations serve. The structs are the C files'
// Problem structs, field for field.
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

namespace {

struct LinearProblem {  // kernels/linear_cpu.c
  const void *x, *w, *scales, *zeros;
  void *y;
  int64_t m, n, k;
  int32_t group, threads;
};

struct DenseProblem {  // kernels/dense_cpu.c
  const void *q, *k, *v, *input_pos;
  void *out;
  int64_t batch, heads, kv_heads, s, d, t;
  float scale;
  int32_t dtype, threads;
};

struct MergeProblem {  // kernels/dense_cpu.c
  const void *rows, *row_max, *row_sum, *lowbit_out;
  const void *k[3], *v[3];
  int64_t k_stride[3][3], v_stride[3][3];
  const void *fetched_valid, *window_len;
  void *out, *lowbit_scale;
  void *p[3];
  int64_t batch, kv_heads, m, d, n[3];
  int32_t dtype[3], threads;
};

struct RankProblem {  // kernels/rank_cpu.c
  const void *weights, *scale, *p_fetched, *fetched_pos, *p_window, *window_start, *upper, *excluded_pos,
      *excluded_valid;
  void *indices, *valid;
  int64_t batch, heads, m, t, n_fetched, n_window, n_excluded, k, lower;
  int32_t s, row, max_over_heads, threads;
};

struct LowbitProblem {  // kernels/lowbit_cpu.c
  const void *rows, *k_packed, *v_packed, *k_scale, *k_zero, *v_scale, *v_zero, *visible_len, *excluded_pos,
      *excluded_valid;
  void *weights, *row_max, *row_sum, *out;
  int64_t batch, heads, m, d, t, k;
  int32_t bits, group, value_groups, bf16, threads;
};

using LinearKernel = int (*)(const LinearProblem *);
using DenseKernel = int (*)(const DenseProblem *);
using MergeKernel = int (*)(const MergeProblem *);
using RankKernel = int (*)(const RankProblem *);
using LowbitKernel = int (*)(const LowbitProblem *);
LinearKernel linear_kernel = nullptr;
DenseKernel dense_kernel = nullptr;
MergeKernel merge_kernel = nullptr;
RankKernel rank_kernel = nullptr;
LowbitKernel lowbit_kernel = nullptr;       // kernels/lowbit_cpu.c
LowbitKernel lowbit_int8_kernel = nullptr;  // kernels/lowbit_int_cpu.c, the same struct

// Positions a call never attends or chooses: excluded_pos (B, Hkv, E) int64, where excluded_valid (same shape, bool).
void check_exclusions(const char *op, const at::Tensor &excluded_pos, const at::Tensor &excluded_valid, int64_t b,
                      int64_t h) {
  TORCH_CHECK_VALUE(excluded_pos.dim() == 3 && excluded_pos.size(0) == b && excluded_pos.size(1) == h &&
                        excluded_pos.scalar_type() == at::kLong && excluded_valid.sizes() == excluded_pos.sizes() &&
                        excluded_valid.scalar_type() == at::kBool,
                    op, ": excluded_pos must be (B, Hkv, E) int64 and excluded_valid bool of its shape");
}

// The op specache_plain::`name`: specache.py's plain-PyTorch definition of specache::`name`, registered by
// kernels/cpu_ops.py, for the shapes a C kernel does not take.
template <typename Signature>
c10::TypedOperatorHandle<Signature> plain(const char *name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string("specache_plain::") + name).c_str(), "")
      .typed<Signature>();
}

// The C kernels' element types: float32, bfloat16, float16.
int32_t dtype_code(at::ScalarType dtype) { return dtype == at::kFloat ? 0 : dtype == at::kBFloat16 ? 1 : 2; }

at::Tensor quantized_linear(const at::Tensor &x_in, const at::Tensor &codes_in, const at::Tensor &scales_in,
                            const std::optional<at::Tensor> &zeros_in, int64_t group) {
  TORCH_CHECK(linear_kernel, "quantized_linear: the C kernel was not handed over");
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(0) >= 1 && x_in.size(0) <= 16,
              "quantized_linear: x must be (M, K) float32 with 1 <= M <= 16");
  const int64_t m = x_in.size(0), k = x_in.size(1), n = codes_in.size(0);
  if (group == 0) {
    TORCH_CHECK_VALUE(codes_in.dim() == 2 && codes_in.scalar_type() == at::kChar && codes_in.size(1) == k,
                "quantized_linear: int8 codes must be (N, K) int8");
    TORCH_CHECK_VALUE(scales_in.dim() == 1 && scales_in.size(0) == n && scales_in.scalar_type() == at::kFloat,
                "quantized_linear: int8 scales must be (N,) float32");
  } else {
    TORCH_CHECK_VALUE(group >= 2 && group % 2 == 0 && k % group == 0, "quantized_linear: the int4 group must be even and divide K");
    TORCH_CHECK_VALUE(codes_in.dim() == 2 && codes_in.scalar_type() == at::kByte && codes_in.size(1) * 2 == k,
                "quantized_linear: int4 codes must be (N, K/2) uint8");
    TORCH_CHECK_VALUE(zeros_in.has_value(), "quantized_linear: int4 needs zeros");
    for (const at::Tensor *t : {&scales_in, &*zeros_in})
      TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == n && t->size(1) == k / group && t->scalar_type() == at::kFloat,
                  "quantized_linear: int4 scales and zeros must be (N, K/group) float32");
  }
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous(), scales = scales_in.contiguous();
  const at::Tensor zeros = group == 0 ? scales : zeros_in->contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const LinearProblem problem{x.data_ptr(), codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), y.data_ptr(), m, n, k,
                              static_cast<int32_t>(group), static_cast<int32_t>(at::get_num_threads())};
  TORCH_CHECK(linear_kernel(&problem) == 0, "linear_cpu.c rejected a problem that passed the checks");
  return y;
}

at::Tensor dense_decode_attention(const at::Tensor &q_in, const at::Tensor &k_in, const at::Tensor &v_in,
                                  const at::Tensor &input_pos_in, std::optional<double> scale) {
  TORCH_CHECK(dense_kernel, "dense_decode_attention: the C kernel was not handed over");
  TORCH_CHECK_VALUE(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "dense_decode_attention: q must be (B, H, S, D) float32");
  const int64_t b = q_in.size(0), h = q_in.size(1), s = q_in.size(2), d = q_in.size(3);
  const auto dtype = k_in.scalar_type();
  TORCH_CHECK_VALUE(k_in.dim() == 4 && k_in.size(0) == b && k_in.size(3) == d &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "dense_decode_attention: k must be (B, Hkv, T, D) float32, bfloat16 or float16");
  TORCH_CHECK_VALUE(v_in.sizes() == k_in.sizes() && v_in.scalar_type() == dtype, "dense_decode_attention: v must be shaped and typed like k");
  const int64_t hkv = k_in.size(1), t = k_in.size(2);
  TORCH_CHECK_VALUE(h % hkv == 0 && h / hkv * s <= 64 && d >= 1 && d <= 256,
              "dense_decode_attention: need H a multiple of Hkv, (H / Hkv) x S <= 64 and D <= 256");
  TORCH_CHECK_VALUE(input_pos_in.dim() == 2 && input_pos_in.size(0) == b && input_pos_in.size(1) == s &&
                  input_pos_in.scalar_type() == at::kLong,
              "dense_decode_attention: input_pos must be (B, S) int64");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), pos = input_pos_in.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int32_t code = dtype_code(dtype);
  const DenseProblem problem{q.data_ptr(), k.data_ptr(), v.data_ptr(), pos.data_ptr(), out.data_ptr(), b, h, hkv, s, d, t,
                             static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d)))), code,
                             static_cast<int32_t>(at::get_num_threads())};
  TORCH_CHECK(dense_kernel(&problem) == 0, "dense_cpu.c rejected a problem that passed the checks");
  return out;
}

// The checks guard the kernel's reads and writes; kernels/dense_cpu.py's _check_merge states the whole contract.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_segments(
    const at::Tensor &rows_in, const at::Tensor &row_max_in, const at::Tensor &row_sum_in, const at::Tensor &lowbit_out_in,
    const at::Tensor &fetched_k, const at::Tensor &fetched_v, const at::Tensor &fetched_valid_in,
    const at::Tensor &window_k, const at::Tensor &window_v, const at::Tensor &window_len_in, const at::Tensor &new_k,
    const at::Tensor &new_v) {
  TORCH_CHECK(merge_kernel, "merge_segments: the C kernel was not handed over");
  TORCH_CHECK_VALUE(rows_in.dim() == 4 && rows_in.scalar_type() == at::kFloat, "merge_segments: rows must be (B, Hkv, M, D) float32");
  const int64_t b = rows_in.size(0), h = rows_in.size(1), m = rows_in.size(2), d = rows_in.size(3);
  TORCH_CHECK_VALUE(m >= 1 && d >= 1, "merge_segments: need M >= 1 and D >= 1");
  for (const at::Tensor *x : {&row_max_in, &row_sum_in})
    TORCH_CHECK_VALUE(x->sizes() == at::IntArrayRef({b, h, m}) && x->scalar_type() == at::kFloat,
                      "merge_segments: row_max and row_sum must be (B, Hkv, M) float32");
  TORCH_CHECK_VALUE(lowbit_out_in.sizes() == rows_in.sizes() && lowbit_out_in.scalar_type() == at::kFloat,
                    "merge_segments: lowbit_out must be (B, Hkv, M, D) float32");
  const at::Tensor *keys[3] = {&fetched_k, &window_k, &new_k}, *values[3] = {&fetched_v, &window_v, &new_v};
  at::Tensor k[3], v[3];
  for (int i = 0; i < 3; i++) {
    const auto dtype = keys[i]->scalar_type();
    TORCH_CHECK_VALUE(keys[i]->dim() == 4 && keys[i]->size(0) == b && keys[i]->size(1) == h && keys[i]->size(3) == d &&
                          (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                          values[i]->sizes() == keys[i]->sizes() && values[i]->scalar_type() == dtype,
                      "merge_segments: each segment's k and v must be (B, Hkv, N, D) float32, bfloat16 or float16 alike");
    k[i] = keys[i]->stride(3) == 1 ? *keys[i] : keys[i]->contiguous();  // positions and heads may be strided
    v[i] = values[i]->stride(3) == 1 ? *values[i] : values[i]->contiguous();
  }
  const int64_t s = new_k.size(2);
  TORCH_CHECK_VALUE(s >= 1 && m % s == 0, "merge_segments: need S >= 1 new pairs and M a multiple of S");
  TORCH_CHECK_VALUE(fetched_valid_in.sizes() == at::IntArrayRef({b, h, fetched_k.size(2)}) &&
                        fetched_valid_in.scalar_type() == at::kBool,
                    "merge_segments: fetched_valid must be (B, Hkv, N) bool");
  TORCH_CHECK_VALUE(window_len_in.dim() == 1 && window_len_in.size(0) == b && window_len_in.scalar_type() == at::kLong,
                    "merge_segments: window_len must be (B,) int64");
  if (m > 64 || d > 256) {  // more rows or channels than the C kernel's registers hold: the reference
    static const auto reference = plain<decltype(merge_segments)>("merge_segments");
    return reference.call(rows_in, row_max_in, row_sum_in, lowbit_out_in, fetched_k, fetched_v, fetched_valid_in,
                          window_k, window_v, window_len_in, new_k, new_v);
  }
  const at::Tensor rows = rows_in.contiguous(), row_max = row_max_in.contiguous(), row_sum = row_sum_in.contiguous(),
                   lowbit_out = lowbit_out_in.contiguous(), fetched_valid = fetched_valid_in.contiguous(),
                   window_len = window_len_in.contiguous();
  at::Tensor out = at::empty({b, h, m, d}, rows.options()), lowbit_scale = at::empty({b, h, m, 1}, rows.options());
  at::Tensor probs[3];
  MergeProblem problem{rows.data_ptr(), row_max.data_ptr(), row_sum.data_ptr(), lowbit_out.data_ptr()};
  for (int i = 0; i < 3; i++) {
    probs[i] = at::empty({b, h, m, k[i].size(2)}, rows.options());
    problem.k[i] = k[i].data_ptr();
    problem.v[i] = v[i].data_ptr();
    for (int j = 0; j < 3; j++) {
      problem.k_stride[i][j] = k[i].stride(j);
      problem.v_stride[i][j] = v[i].stride(j);
    }
    problem.p[i] = probs[i].data_ptr();
    problem.n[i] = k[i].size(2);
    problem.dtype[i] = dtype_code(k[i].scalar_type());
  }
  problem.fetched_valid = fetched_valid.data_ptr();
  problem.window_len = window_len.data_ptr();
  problem.out = out.data_ptr();
  problem.lowbit_scale = lowbit_scale.data_ptr();
  problem.batch = b;
  problem.kv_heads = h;
  problem.m = m;
  problem.d = d;
  problem.threads = static_cast<int32_t>(at::get_num_threads());
  TORCH_CHECK(merge_kernel(&problem) == 0, "dense_cpu.c rejected a merge that passed the checks");
  return {out, lowbit_scale, probs[0], probs[1], probs[2]};
}

// The checks guard the kernel's reads and writes; kernels/lowbit_cpu.py's _check states the whole contract.
// Integer: specache::lowbit_partial_attention_int8, the same contract with kernels/lowbit_int_cpu.c.
template <bool integer>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lowbit_partial_attention(
    const at::Tensor &rows_in, const at::Tensor &k_packed_in, const at::Tensor &k_scale_in, const at::Tensor &k_zero_in,
    const at::Tensor &v_packed_in, const at::Tensor &v_scale_in, const at::Tensor &v_zero_in, int64_t bits, int64_t group,
    const at::Tensor &visible_len_in, const at::Tensor &excluded_pos_in, const at::Tensor &excluded_valid_in) {
  const LowbitKernel kernel = integer ? lowbit_int8_kernel : lowbit_kernel;
  const char *name = integer ? "lowbit_partial_attention_int8" : "lowbit_partial_attention";
  TORCH_CHECK(kernel, name, ": the C kernel was not handed over");
  TORCH_CHECK_VALUE(rows_in.dim() == 4 && rows_in.scalar_type() == at::kFloat,
                    "lowbit_partial_attention: rows must be (B, Hkv, M, D) float32");
  const int64_t b = rows_in.size(0), h = rows_in.size(1), m = rows_in.size(2), d = rows_in.size(3);
  TORCH_CHECK_VALUE(b >= 1 && h >= 1, "lowbit_partial_attention: need B and Hkv >= 1");
  TORCH_CHECK_VALUE(bits == 1 || bits == 2, "lowbit_partial_attention: bits must be 1 or 2");
  TORCH_CHECK_VALUE(group > 0, "lowbit_partial_attention: the group must be positive");
  TORCH_CHECK_VALUE(k_packed_in.dim() == 4 && k_packed_in.size(2) > 0, "lowbit_partial_attention: k_packed must be (B, Hkv, T > 0, D*bits/8)");
  const int64_t t = k_packed_in.size(2), nbytes = d * bits / 8, groups = (t + group - 1) / group;
  const int64_t value_groups = v_scale_in.dim() == 4 ? v_scale_in.size(3) : 0;
  TORCH_CHECK_VALUE(value_groups > 0 && d % value_groups == 0 && d / value_groups == std::min<int64_t>(group, d),
                    "lowbit_partial_attention: v_scale must be (B, Hkv, T, D / min(group, D))");
  const auto scale_type = k_scale_in.scalar_type();
  TORCH_CHECK_VALUE(scale_type == at::kHalf || scale_type == at::kBFloat16, "lowbit_partial_attention: scales must be float16 or bfloat16");
  const std::pair<const at::Tensor *, std::vector<int64_t>> shapes[] = {
      {&k_packed_in, {b, h, t, nbytes}}, {&v_packed_in, {b, h, t, nbytes}}, {&k_scale_in, {b, h, groups, d}},
      {&k_zero_in, {b, h, groups, d}}, {&v_scale_in, {b, h, t, value_groups}}, {&v_zero_in, {b, h, t, value_groups}}};
  for (const auto &[x, shape] : shapes)
    TORCH_CHECK_VALUE(x->sizes() == at::IntArrayRef(shape) &&
                          x->scalar_type() == (x == &k_packed_in || x == &v_packed_in ? at::kByte : scale_type),
                      "lowbit_partial_attention: the low-bit copy's tensors do not have kernels/quant.py's layout");
  TORCH_CHECK_VALUE(visible_len_in.dim() == 1 && visible_len_in.size(0) == b && visible_len_in.scalar_type() == at::kLong,
                    "lowbit_partial_attention: visible_len must be (B,) int64");
  check_exclusions("lowbit_partial_attention", excluded_pos_in, excluded_valid_in, b, h);
  if (!(d % 16 == 0 && d >= 16 && d <= 256 && group % 8 == 0 && group <= (1 << 20))) {
    // a shape the C kernel does not take: specache.py's reference
    static const auto reference = plain<decltype(lowbit_partial_attention<integer>)>(name);
    return reference.call(rows_in, k_packed_in, k_scale_in, k_zero_in, v_packed_in, v_scale_in, v_zero_in, bits, group,
                          visible_len_in, excluded_pos_in, excluded_valid_in);
  }
  const at::Tensor rows = rows_in.contiguous(), k_packed = k_packed_in.contiguous(), v_packed = v_packed_in.contiguous(),
                   k_scale = k_scale_in.contiguous(), k_zero = k_zero_in.contiguous(), v_scale = v_scale_in.contiguous(),
                   v_zero = v_zero_in.contiguous(), visible_len = visible_len_in.contiguous(),
                   excluded_pos = excluded_pos_in.contiguous(), excluded_valid = excluded_valid_in.contiguous();
  at::Tensor weights = at::empty({b, h, m, t}, rows.options()), row_max = at::empty({b, h, m}, rows.options());
  at::Tensor row_sum = at::empty({b, h, m}, rows.options()), out = at::empty({b, h, m, d}, rows.options());
  const LowbitProblem problem{rows.data_ptr(), k_packed.data_ptr(), v_packed.data_ptr(), k_scale.data_ptr(),
                              k_zero.data_ptr(), v_scale.data_ptr(), v_zero.data_ptr(), visible_len.data_ptr(),
                              excluded_pos.data_ptr(), excluded_valid.data_ptr(), weights.data_ptr(), row_max.data_ptr(),
                              row_sum.data_ptr(), out.data_ptr(), b, h, m, d, t, excluded_pos.size(2),
                              static_cast<int32_t>(bits), static_cast<int32_t>(group), static_cast<int32_t>(value_groups),
                              scale_type == at::kBFloat16 ? 1 : 0, static_cast<int32_t>(at::get_num_threads())};
  TORCH_CHECK(kernel(&problem) == 0, name, ": the C kernel rejected a problem that passed the checks");
  return {weights, row_max, row_sum, out};
}

// The checks guard the kernel's reads and writes; kernels/rank_cpu.py's _check states the whole contract.
std::tuple<at::Tensor, at::Tensor> top_positions(const at::Tensor &weights_in, const at::Tensor &scale_in,
                                                 const at::Tensor &p_fetched_in, const at::Tensor &fetched_pos_in,
                                                 const at::Tensor &p_window_in, const at::Tensor &window_start_in,
                                                 int64_t s, int64_t row, bool gqa_max, int64_t lower,
                                                 const at::Tensor &upper_in, const at::Tensor &excluded_pos_in,
                                                 const at::Tensor &excluded_valid_in, int64_t k) {
  TORCH_CHECK(rank_kernel, "top_positions: the C kernel was not handed over");
  TORCH_CHECK_VALUE(weights_in.dim() == 4 && weights_in.scalar_type() == at::kFloat,
                    "top_positions: weights must be (B, Hkv, M, T) float32");
  const int64_t b = weights_in.size(0), h = weights_in.size(1), m = weights_in.size(2), t = weights_in.size(3);
  TORCH_CHECK_VALUE(b >= 1 && h >= 1 && s >= 1 && m >= s && m % s == 0 && row >= 0 && row < s && k >= 0,
                    "top_positions: need B, Hkv >= 1, M a positive multiple of S, 0 <= row < S, k >= 0");
  TORCH_CHECK_VALUE(scale_in.numel() == b * h * m && scale_in.dim() >= 3 && scale_in.size(0) == b && scale_in.size(1) == h &&
                        scale_in.size(2) == m && scale_in.scalar_type() == at::kFloat,
                    "top_positions: scale must be (B, Hkv, M) float32");
  for (const at::Tensor *x : {&p_fetched_in, &p_window_in})
    TORCH_CHECK_VALUE(x->dim() == 4 && x->size(0) == b && x->size(1) == h && x->size(2) == m && x->scalar_type() == at::kFloat,
                      "top_positions: p_fetched and p_window must be (B, Hkv, M, N) float32");
  TORCH_CHECK_VALUE(fetched_pos_in.dim() == 3 && fetched_pos_in.size(0) == b && fetched_pos_in.size(1) == h &&
                        fetched_pos_in.size(2) == p_fetched_in.size(3) && fetched_pos_in.scalar_type() == at::kLong,
                    "top_positions: fetched_pos must be (B, Hkv, K) int64");
  for (const at::Tensor *x : {&window_start_in, &upper_in})
    TORCH_CHECK_VALUE(x->dim() == 1 && x->size(0) == b && x->scalar_type() == at::kLong,
                      "top_positions: window_start and upper must be (B,) int64");
  check_exclusions("top_positions", excluded_pos_in, excluded_valid_in, b, h);
  const at::Tensor weights = weights_in.contiguous(), scale = scale_in.contiguous(), p_fetched = p_fetched_in.contiguous(),
                   fetched_pos = fetched_pos_in.contiguous(), p_window = p_window_in.contiguous(),
                   window_start = window_start_in.contiguous(), upper = upper_in.contiguous(),
                   excluded_pos = excluded_pos_in.contiguous(), excluded_valid = excluded_valid_in.contiguous();
  at::Tensor indices = at::empty({b, h, k}, fetched_pos.options());
  at::Tensor valid = at::empty({b, h, k}, excluded_valid.options());
  const RankProblem problem{weights.data_ptr(), scale.data_ptr(), p_fetched.data_ptr(), fetched_pos.data_ptr(),
                            p_window.data_ptr(), window_start.data_ptr(), upper.data_ptr(), excluded_pos.data_ptr(),
                            excluded_valid.data_ptr(), indices.data_ptr(), valid.data_ptr(), b, h, m, t,
                            p_fetched.size(3), p_window.size(3), excluded_pos.size(2), k, lower,
                            static_cast<int32_t>(s), static_cast<int32_t>(row), gqa_max ? 1 : 0,
                            static_cast<int32_t>(at::get_num_threads())};
  TORCH_CHECK(rank_kernel(&problem) == 0, "rank_cpu.c rejected a problem that passed the checks");
  return {indices, valid};
}

// specache::step_attention: a layer's whole attention in a decode step, its slow tier in the same RAM (specache.py's
// step_attention_reference states it). The low-bit pass runs over all KV heads (its kernel splits the positions among
// the threads); everything else, small beside it, runs KV head by KV head on the C kernels above: the merge, the real
// row's ranking, its picks' gather into the slots and their drop from the low-bit sums, the merge again, the last
// row's ranking and the prefetch's gather. Shapes the kernels do not take go to the reference.
constexpr float kDropRounding = 1e-5f;  // specache.py's DROP_ROUNDING

using StepResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

StepResult step_attention(const at::Tensor &rows_in, const at::Tensor &k_packed, const at::Tensor &k_scale,
                          const at::Tensor &k_zero, const at::Tensor &v_packed_in, const at::Tensor &v_scale_in,
                          const at::Tensor &v_zero_in, int64_t bits, int64_t group, bool integer,
                          const at::Tensor &quantized_len_in, const at::Tensor &fetched_k, const at::Tensor &fetched_v,
                          const at::Tensor &fetched_pos, const at::Tensor &fetched_valid, const at::Tensor &window_k_in,
                          const at::Tensor &window_v_in, const at::Tensor &window_len_in, const at::Tensor &new_k_in,
                          const at::Tensor &new_v_in, const at::Tensor &store_k_in, const at::Tensor &store_v_in,
                          int64_t n_picks, const std::optional<at::Tensor> &discard_in, bool gqa_max, int64_t n_sinks,
                          int64_t n_spec, const at::Tensor &selectable_len_in) {
  const int64_t b = rows_in.size(0), h = rows_in.size(1), m = rows_in.dim() == 4 ? rows_in.size(2) : 0,
                d = rows_in.dim() == 4 ? rows_in.size(3) : 0, t = k_packed.dim() == 4 ? k_packed.size(2) : 0;
  const int64_t slots = fetched_k.dim() == 4 ? fetched_k.size(2) : -1, s = new_k_in.dim() == 4 ? new_k_in.size(2) : 0;
  const auto pair_type = fetched_k.scalar_type();
  bool fusable = (integer ? lowbit_int8_kernel : lowbit_kernel) && merge_kernel && rank_kernel && rows_in.dim() == 4 &&
                 rows_in.scalar_type() == at::kFloat && t > 0 && m >= 1 && m <= 64 && s >= 1 && m % s == 0 &&
                 d % 16 == 0 && d >= 16 && d <= 256 && group % 8 == 0 && (bits == 1 || bits == 2) &&
                 n_picks >= 0 && n_spec >= 0 && n_sinks >= 0 && n_sinks + n_spec <= slots &&
                 (n_picks == 0 || n_picks >= slots - n_sinks - (discard_in ? 0 : n_spec)) &&  // else it raises
                 v_packed_in.dim() == 4 && v_scale_in.dim() == 4 && v_scale_in.size(3) > 0 &&
                 d % v_scale_in.size(3) == 0 && quantized_len_in.dim() == 1 && quantized_len_in.size(0) == b &&
                 quantized_len_in.scalar_type() == at::kLong && selectable_len_in.sizes() == quantized_len_in.sizes() &&
                 selectable_len_in.scalar_type() == at::kLong && (!discard_in || (discard_in->sizes() == at::IntArrayRef({b, h}) &&
                                                                  discard_in->scalar_type() == at::kBool));
  const at::Tensor *pairs[] = {&fetched_v, &window_k_in, &window_v_in, &new_k_in, &new_v_in, &store_k_in, &store_v_in};
  for (const at::Tensor *x : pairs)  // the gathers copy whole pairs: the slots, the window and the tier in one dtype
    fusable = fusable && x->dim() == 4 && x->size(0) == b && x->size(1) == h && x->size(3) == d &&
              (x->scalar_type() == pair_type || (x == &new_k_in || x == &new_v_in));
  const auto new_type = new_k_in.scalar_type();
  fusable = fusable && new_v_in.scalar_type() == new_type &&
            (new_type == at::kFloat || new_type == at::kBFloat16 || new_type == at::kHalf);
  fusable = fusable && fetched_v.sizes() == fetched_k.sizes() && store_v_in.sizes() == store_k_in.sizes() &&
            window_v_in.sizes() == window_k_in.sizes() && new_v_in.sizes() == new_k_in.sizes() &&
            store_k_in.size(2) >= 1 && window_len_in.sizes() == quantized_len_in.sizes() &&
            window_len_in.scalar_type() == at::kLong &&
            fetched_pos.sizes() == at::IntArrayRef({b, h, slots}) && fetched_pos.scalar_type() == at::kLong &&
            fetched_valid.sizes() == fetched_pos.sizes() && fetched_valid.scalar_type() == at::kBool &&
            (pair_type == at::kFloat || pair_type == at::kBFloat16 || pair_type == at::kHalf);
  if (!fusable) {
    static const auto reference = plain<decltype(step_attention)>("step_attention");
    return reference.call(rows_in, k_packed, k_scale, k_zero, v_packed_in, v_scale_in, v_zero_in, bits, group, integer,
                          quantized_len_in, fetched_k, fetched_v, fetched_pos, fetched_valid, window_k_in, window_v_in,
                          window_len_in, new_k_in, new_v_in, store_k_in, store_v_in, n_picks, discard_in, gqa_max,
                          n_sinks, n_spec, selectable_len_in);
  }
  const at::Tensor rows = rows_in.contiguous(), quantized_len = quantized_len_in.contiguous(),
                   selectable_len = selectable_len_in.contiguous(), store_k = store_k_in.contiguous(),
                   store_v = store_v_in.contiguous(), v_packed = v_packed_in.contiguous(), v_scale = v_scale_in.contiguous(),
                   v_zero = v_zero_in.contiguous();
  const at::Tensor discard = discard_in ? discard_in->contiguous() : at::Tensor();
  const int64_t *qlen = quantized_len.data_ptr<int64_t>();
  // exact_slots: the slots that count, and the low-bit pass leaves out
  at::Tensor exact = fetched_valid.contiguous().clone();
  at::Tensor out_pos = fetched_pos.contiguous().clone(), out_valid = fetched_valid.contiguous().clone();
  {
    bool *ex = exact.data_ptr<bool>();
    const int64_t *pos = out_pos.data_ptr<int64_t>();
    for (int64_t bh = 0; bh < b * h; bh++)
      for (int64_t j = 0; j < slots; j++) {
        const bool dropped = j >= n_sinks + n_spec || (j >= n_sinks && discard.defined() && discard.data_ptr<bool>()[bh]);
        ex[bh * slots + j] = ex[bh * slots + j] && pos[bh * slots + j] < qlen[bh / h] && !dropped;
      }
  }
  auto [weights, row_max, row_sum, lowbit_out] =
      (integer ? lowbit_partial_attention<true> : lowbit_partial_attention<false>)(
          rows, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, bits, group, quantized_len, out_pos, exact);
  TORCH_CHECK(weights.is_contiguous() && row_max.is_contiguous() && row_sum.is_contiguous() && lowbit_out.is_contiguous(),
              "step_attention: the low-bit pass returned strided tensors");
  at::Tensor out_k = fetched_k.contiguous().clone(), out_v = fetched_v.contiguous().clone();
  const at::Tensor window_k = window_k_in.stride(3) == 1 ? window_k_in : window_k_in.contiguous(),
                   window_v = window_v_in.stride(3) == 1 ? window_v_in : window_v_in.contiguous(),
                   new_k = new_k_in.stride(3) == 1 ? new_k_in : new_k_in.contiguous(),
                   new_v = new_v_in.stride(3) == 1 ? new_v_in : new_v_in.contiguous(),
                   window_len = window_len_in.contiguous();
  const at::Tensor *keys[3] = {&out_k, &window_k, &new_k}, *values[3] = {&out_v, &window_v, &new_v};
  at::Tensor out = at::empty({b, h, m, d}, rows.options()), lowbit_scale = at::empty({b, h, m}, rows.options());
  at::Tensor probs[3];
  for (int i = 0; i < 3; i++) probs[i] = at::empty({b, h, m, keys[i]->size(2)}, rows.options());
  at::Tensor picks = at::empty({b, h, n_picks}, out_pos.options()), picked = at::empty({b, h, n_picks}, exact.options());
  at::Tensor placed = at::empty({b, h, n_picks}, exact.options());
  at::Tensor kappa_pos = at::empty({b, h, n_spec}, out_pos.options()), kappa_valid = at::empty({b, h, n_spec}, exact.options());
  const int64_t store_t = store_k.size(2), pair_bytes = d * store_k.element_size(), window = window_k.size(2);
  const int64_t value_groups = v_scale.size(3), nbytes = d * bits / 8;
  const bool bf16_scales = v_scale.scalar_type() == at::kBFloat16;
  const void *value_scale = v_scale.data_ptr(), *value_zero = v_zero.data_ptr();
  auto scale_at = [&](const void *x, int64_t i) {
    return bf16_scales ? static_cast<float>(static_cast<const at::BFloat16 *>(x)[i])
                       : static_cast<float>(static_cast<const at::Half *>(x)[i]);
  };
  auto merge_head = [&](int64_t bh, int64_t bi, int64_t hi) {
    MergeProblem p{rows.data_ptr<float>() + bh * m * d, row_max.data_ptr<float>() + bh * m,
                   row_sum.data_ptr<float>() + bh * m, lowbit_out.data_ptr<float>() + bh * m * d};
    for (int i = 0; i < 3; i++) {
      const int64_t size = keys[i]->element_size();
      p.k[i] = static_cast<const char *>(keys[i]->data_ptr()) + (bi * keys[i]->stride(0) + hi * keys[i]->stride(1)) * size;
      p.v[i] = static_cast<const char *>(values[i]->data_ptr()) + (bi * values[i]->stride(0) + hi * values[i]->stride(1)) * size;
      for (int j = 0; j < 3; j++) {
        p.k_stride[i][j] = keys[i]->stride(j);
        p.v_stride[i][j] = values[i]->stride(j);
      }
      p.p[i] = probs[i].data_ptr<float>() + bh * m * probs[i].size(3);
      p.n[i] = probs[i].size(3);
      p.dtype[i] = dtype_code(keys[i]->scalar_type());
    }
    p.fetched_valid = exact.data_ptr<bool>() + bh * slots;
    p.window_len = window_len.data_ptr<int64_t>() + bi;
    p.out = out.data_ptr<float>() + bh * m * d;
    p.lowbit_scale = lowbit_scale.data_ptr<float>() + bh * m;
    p.batch = p.kv_heads = 1;
    p.m = m;
    p.d = d;
    p.threads = 1;
    return merge_kernel(&p);
  };
  auto rank_head = [&](int64_t bh, int64_t bi, int64_t row, int64_t lower, const int64_t *upper, int64_t n_excluded,
                       int64_t k, int64_t *indices, bool *valid) {
    const RankProblem p{weights.data_ptr<float>() + bh * m * t, lowbit_scale.data_ptr<float>() + bh * m,
                        probs[0].data_ptr<float>() + bh * m * slots, out_pos.data_ptr<int64_t>() + bh * slots,
                        probs[1].data_ptr<float>() + bh * m * window, qlen + bi, upper,
                        out_pos.data_ptr<int64_t>() + bh * slots, exact.data_ptr<bool>() + bh * slots, indices, valid,
                        1, 1, m, t, slots, window, n_excluded, k, lower, static_cast<int32_t>(s),
                        static_cast<int32_t>(row), gqa_max ? 1 : 0, 1};
    return rank_kernel(&p);
  };
  auto copy_pair = [&](int64_t bh, int64_t slot, int64_t position) {  // slot <- the tier's pair at position
    const int64_t at_pos = std::min(std::max<int64_t>(position, 0), store_t - 1);
    const int64_t from = (bh * store_t + at_pos) * pair_bytes, to = (bh * slots + slot) * pair_bytes;
    std::memcpy(static_cast<char *>(out_k.data_ptr()) + to, static_cast<const char *>(store_k.data_ptr()) + from, pair_bytes);
    std::memcpy(static_cast<char *>(out_v.data_ptr()) + to, static_cast<const char *>(store_v.data_ptr()) + from, pair_bytes);
  };
  // drop_from_lowbit: the placed picks' weights leave the low-bit sums, and their weighted values its output
  const int64_t channels_per_group = d / value_groups;
  auto drop_head = [&](int64_t bh, const int64_t *positions, const bool *valid) {
    float *w = weights.data_ptr<float>() + bh * m * t, *sum = row_sum.data_ptr<float>() + bh * m;
    float *acc = lowbit_out.data_ptr<float>() + bh * m * d;
    const uint8_t *packed = v_packed.data_ptr<uint8_t>();
    std::vector<float> value(d), dropped_sum(m, 0.0f), dropped_out(m * d, 0.0f);
    for (int64_t r = 0; r < n_picks; r++) {
      if (!valid[r]) continue;
      const int64_t at_pos = bh * t + positions[r];
      const uint8_t *codes = packed + at_pos * nbytes;
      for (int64_t g = 0; g < value_groups; g++) {  // dequantize_values
        const float scale = scale_at(value_scale, at_pos * value_groups + g);
        const float zero = scale_at(value_zero, at_pos * value_groups + g);
        for (int64_t c = g * channels_per_group; c < (g + 1) * channels_per_group; c++) {
          const int code = (codes[c * bits / 8] >> (c * bits % 8)) & ((1 << bits) - 1);
          value[c] = static_cast<float>(code) * scale + zero;
        }
      }
      for (int64_t row = 0; row < m; row++) {
        const float weight = w[row * t + positions[r]];
        w[row * t + positions[r]] = 0.0f;
        dropped_sum[row] += weight;
        float *dropped = dropped_out.data() + row * d;
        for (int64_t c = 0; c < d; c++) dropped[c] += weight * value[c];
      }
    }
    for (int64_t row = 0; row < m; row++) {
      const bool left = sum[row] - dropped_sum[row] > sum[row] * kDropRounding;  // else what is left is noise
      sum[row] = left ? sum[row] - dropped_sum[row] : 0.0f;
      for (int64_t c = 0; c < d; c++) acc[row * d + c] = left ? acc[row * d + c] - dropped_out[row * d + c] : 0.0f;
    }
  };
  std::atomic<int> failed{0};
  auto one_head = [&](int64_t bh) {
    const int64_t bi = bh / h, hi = bh % h;
    int64_t *pos = out_pos.data_ptr<int64_t>() + bh * slots;
    bool *ex = exact.data_ptr<bool>() + bh * slots;
    if (n_picks) {
      int64_t *index = picks.data_ptr<int64_t>() + bh * n_picks;
      bool *valid = picked.data_ptr<bool>() + bh * n_picks, *fits = placed.data_ptr<bool>() + bh * n_picks;
      // a kernel that fails leaves nothing to go on with: this head stops, and the call raises below
      if (merge_head(bh, bi, hi) || rank_head(bh, bi, 0, 0, qlen + bi, slots, n_picks, index, valid))
        return void(failed = 1);
      const int64_t first = discard.defined() && discard.data_ptr<bool>()[bh] ? n_sinks : n_sinks + n_spec;
      for (int64_t r = 0; r < n_picks; r++) fits[r] = valid[r] && r < slots - first;
      for (int64_t j = first; j < slots; j++) {
        const int64_t r = std::min(j - first, n_picks - 1);
        copy_pair(bh, j, index[r]);
        pos[j] = index[r];
        ex[j] = fits[r];
      }
      drop_head(bh, index, fits);
    }
    if (merge_head(bh, bi, hi)) return void(failed = 1);
    if (n_spec) {
      int64_t *kappa = kappa_pos.data_ptr<int64_t>() + bh * n_spec;
      bool *real = kappa_valid.data_ptr<bool>() + bh * n_spec;
      if (rank_head(bh, bi, s - 1, n_sinks, selectable_len.data_ptr<int64_t>() + bi, 0, n_spec, kappa, real))
        return void(failed = 1);
      bool *valid_out = out_valid.data_ptr<bool>() + bh * slots;
      for (int64_t i = 0; i < n_spec; i++) {
        copy_pair(bh, n_sinks + i, kappa[i]);
        pos[n_sinks + i] = kappa[i];
        valid_out[n_sinks + i] = real[i];
      }
    }
  };
  // KV heads on threads, even 3 on 2 (SmolLM2): 200 against 245 us a call at 1k, 730 against 850 at 16k, in a step
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; bh++) one_head(bh);
  });
  TORCH_CHECK(!failed, "step_attention: a C kernel rejected a problem that passed the checks");
  return {out, out_k, out_v, out_pos, out_valid, placed, kappa_pos, kappa_valid};
}

// Registers `impl` as the op's implementation for CPU tensors, ahead of the Python one (for the process's life).
template <typename Impl>
void register_cpu(const char *op, Impl impl) {
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  libraries.push_back(
      std::make_unique<torch::Library>(torch::Library::IMPL, "specache", c10::DispatchKey::CPU, __FILE__, __LINE__));
  libraries.back()->impl(op, impl);
}

// Keeps a C kernel's address in `slot`; the first time, registers the op's C++ implementation `impl`.
template <typename Kernel, typename Impl>
void hand_over(Kernel &slot, int64_t address, const char *op, Impl impl) {
  const bool first = slot == nullptr;
  slot = reinterpret_cast<Kernel>(address);
  if (first) register_cpu(op, impl);  // else registered already; the new address serves
}

// The op `name`'s C kernel is at `address`: keep it and register the C++ implementation for CPU tensors.
void set_cpu_kernel(const std::string &name, int64_t address) {
  TORCH_CHECK(address != 0, "set_cpu_kernel: a null address");
  const char *op = name.c_str();
  if (name == "quantized_linear")
    hand_over(linear_kernel, address, op, &quantized_linear);
  else if (name == "dense_decode_attention")
    hand_over(dense_kernel, address, op, &dense_decode_attention);
  else if (name == "merge_segments")
    hand_over(merge_kernel, address, op, &merge_segments);
  else if (name == "top_positions")
    hand_over(rank_kernel, address, op, &top_positions);
  else if (name == "lowbit_partial_attention")
    hand_over(lowbit_kernel, address, op, &lowbit_partial_attention<false>);
  else if (name == "lowbit_partial_attention_int8")
    hand_over(lowbit_int8_kernel, address, op, &lowbit_partial_attention<true>);
  else
    TORCH_CHECK(false, "set_cpu_kernel: no C++ implementation of ", name);
}

// specache::step_attention's C++ implementation, for CPU tensors, once the kernels it runs are handed over and
// kernels/cpu_ops.py has registered its reference as specache_plain::step_attention (the fallback); false until then.
bool enable_step_attention() {
  static bool registered = false;
  const bool fallback = c10::Dispatcher::singleton().findSchema({"specache_plain::step_attention", ""}).has_value();
  if (registered || !(lowbit_kernel && merge_kernel && rank_kernel && fallback)) return registered;
  register_cpu("step_attention", &step_attention);
  return registered = true;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specache, m) {
  m.def("set_cpu_kernel(str name, int address) -> ()", &set_cpu_kernel);
  m.def("enable_step_attention() -> bool", &enable_step_attention);
}
