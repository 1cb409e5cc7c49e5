// The host's CPU ops that a decode step calls most, dispatched in C++: gptfast::quantized_linear
// (about 150 calls a step on SmolLM2) and gptfast::dense_decode_attention (one per layer of the full
// cache). Their Python implementations (linear_cpu.py, dense_cpu.py: `_op`) check the inputs, fill
// a ctypes struct and call the C kernel, about 12 us a call; this does the same in about 2.
//
// host_ops.py builds it at first use against the running torch's headers and SpeCache's dispatch
// header (specache/kernels/cpu_ops.h: how a kernel is handed over and registered). Each kernel's
// module hands over its C function's address once it has built it (gptfast::set_cpu_kernel), and
// only then does this file register its implementation of that op for CPU tensors, ahead of the
// Python one; where this file does not build, the Python implementations serve.

#include "cpu_ops.h"

namespace gptfast_cpu {
namespace {

using specache_cpu::dtype_code;
using specache_cpu::hand_over;

struct LinearProblem {  // linear_cpu.c
  const void *x, *w, *scales, *zeros;
  void *y;
  int64_t m, n, k;
  int32_t group, threads;
};

struct DenseProblem {  // dense_cpu.c
  const void *q, *k, *v, *input_pos;
  void *out;
  int64_t batch, heads, kv_heads, s, d, t;
  float scale;
  int32_t dtype, threads;
};

using LinearKernel = int (*)(const LinearProblem *);
using DenseKernel = int (*)(const DenseProblem *);
LinearKernel linear_kernel = nullptr;
DenseKernel dense_kernel = nullptr;

at::Tensor quantized_linear(const at::Tensor &x_in, const at::Tensor &codes_in,
                            const at::Tensor &scales_in, const std::optional<at::Tensor> &zeros_in,
                            int64_t group) {
  TORCH_CHECK(linear_kernel, "quantized_linear: the C kernel was not handed over");
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(0) >= 1 &&
                        x_in.size(0) <= 16,
                    "quantized_linear: x must be (M, K) float32 with 1 <= M <= 16");
  const int64_t m = x_in.size(0), k = x_in.size(1), n = codes_in.size(0);
  if (group == 0) {
    TORCH_CHECK_VALUE(
        codes_in.dim() == 2 && codes_in.scalar_type() == at::kChar && codes_in.size(1) == k,
        "quantized_linear: int8 codes must be (N, K) int8");
    TORCH_CHECK_VALUE(
        scales_in.dim() == 1 && scales_in.size(0) == n && scales_in.scalar_type() == at::kFloat,
        "quantized_linear: int8 scales must be (N,) float32");
  } else {
    TORCH_CHECK_VALUE(group >= 2 && group % 2 == 0 && k % group == 0,
                      "quantized_linear: the int4 group must be even and divide K");
    TORCH_CHECK_VALUE(
        codes_in.dim() == 2 && codes_in.scalar_type() == at::kByte && codes_in.size(1) * 2 == k,
        "quantized_linear: int4 codes must be (N, K/2) uint8");
    TORCH_CHECK_VALUE(zeros_in.has_value(), "quantized_linear: int4 needs zeros");
    for (const at::Tensor *t : {&scales_in, &*zeros_in})
      TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == n && t->size(1) == k / group &&
                            t->scalar_type() == at::kFloat,
                        "quantized_linear: int4 scales and zeros must be (N, K/group) float32");
  }
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous(),
                   scales = scales_in.contiguous();
  const at::Tensor zeros = group == 0 ? scales : zeros_in->contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const LinearProblem problem{x.data_ptr(),
                              codes.data_ptr(),
                              scales.data_ptr(),
                              zeros.data_ptr(),
                              y.data_ptr(),
                              m,
                              n,
                              k,
                              static_cast<int32_t>(group),
                              static_cast<int32_t>(at::get_num_threads())};
  TORCH_CHECK(linear_kernel(&problem) == 0,
              "linear_cpu.c rejected a problem that passed the checks");
  return y;
}

at::Tensor dense_decode_attention(const at::Tensor &q_in, const at::Tensor &k_in,
                                  const at::Tensor &v_in, const at::Tensor &input_pos_in,
                                  std::optional<double> scale) {
  TORCH_CHECK(dense_kernel, "dense_decode_attention: the C kernel was not handed over");
  TORCH_CHECK_VALUE(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat,
                    "dense_decode_attention: q must be (B, H, S, D) float32");
  const int64_t b = q_in.size(0), h = q_in.size(1), s = q_in.size(2), d = q_in.size(3);
  const auto dtype = k_in.scalar_type();
  TORCH_CHECK_VALUE(
      k_in.dim() == 4 && k_in.size(0) == b && k_in.size(3) == d &&
          (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
      "dense_decode_attention: k must be (B, Hkv, T, D) float32, bfloat16 or float16");
  TORCH_CHECK_VALUE(v_in.sizes() == k_in.sizes() && v_in.scalar_type() == dtype,
                    "dense_decode_attention: v must be shaped and typed like k");
  const int64_t hkv = k_in.size(1), t = k_in.size(2);
  TORCH_CHECK_VALUE(
      h % hkv == 0 && h / hkv * s <= 64 && d >= 1 && d <= 256,
      "dense_decode_attention: need H a multiple of Hkv, (H / Hkv) x S <= 64 and D <= 256");
  TORCH_CHECK_VALUE(input_pos_in.dim() == 2 && input_pos_in.size(0) == b &&
                        input_pos_in.size(1) == s && input_pos_in.scalar_type() == at::kLong,
                    "dense_decode_attention: input_pos must be (B, S) int64");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(),
                   pos = input_pos_in.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int32_t code = dtype_code(dtype);
  const DenseProblem problem{
      q.data_ptr(),
      k.data_ptr(),
      v.data_ptr(),
      pos.data_ptr(),
      out.data_ptr(),
      b,
      h,
      hkv,
      s,
      d,
      t,
      static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d)))),
      code,
      static_cast<int32_t>(at::get_num_threads())};
  TORCH_CHECK(dense_kernel(&problem) == 0, "dense_cpu.c rejected a problem that passed the checks");
  return out;
}

// The op `name`'s C kernel is at `address`, and its Problem struct is `problem_bytes` long: keep
// it and register the C++ implementation for CPU tensors.
void set_cpu_kernel(const std::string &name, int64_t address, int64_t problem_bytes) {
  TORCH_CHECK(address != 0, "set_cpu_kernel: a null address");
  const char *op = name.c_str();
  if (name == "quantized_linear")
    hand_over("gptfast", linear_kernel, address, op, &quantized_linear, problem_bytes);
  else if (name == "dense_decode_attention")
    hand_over("gptfast", dense_kernel, address, op, &dense_decode_attention, problem_bytes);
  else
    TORCH_CHECK(false, "set_cpu_kernel: no C++ implementation of ", name);
}

}  // namespace
}  // namespace gptfast_cpu

TORCH_LIBRARY_FRAGMENT(gptfast, m) {
  m.def("set_cpu_kernel(str name, int address, int problem_bytes) -> ()",
        &gptfast_cpu::set_cpu_kernel);
}
