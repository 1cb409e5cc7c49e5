// SpeCache's CPU ops dispatched in C++: specache::lowbit_partial_attention (or its _int8 and
// _sparse twins), specache::merge_segments and specache::top_positions, which
// specache::step_attention (step_cpu.cpp) chains in one call per layer. Their Python
// implementations (lowbit_cpu.py, merge_cpu.py, rank_cpu.py) check the inputs, fill a ctypes
// struct and call the C kernel, about 12 us a call; this does the same in about 2.
//
// cpu_ops.py builds it, with step_cpu.cpp, at first use against the running torch's headers. Each
// kernel's module hands over its C function's address once it has built it
// (specache::set_cpu_kernel), and only then does this file register its implementation of that op
// for CPU tensors, ahead of the Python one; where this file does not build, the Python
// implementations serve.

#include "cpu_ops.h"

namespace specache_cpu {
namespace {

// Positions a call never attends or chooses: excluded_pos (B, Hkv, E) int64, where excluded_valid
// (same shape, bool).
void check_exclusions(const char *op, const at::Tensor &excluded_pos,
                      const at::Tensor &excluded_valid, int64_t b, int64_t h) {
  TORCH_CHECK_VALUE(
      excluded_pos.dim() == 3 && excluded_pos.size(0) == b && excluded_pos.size(1) == h &&
          excluded_pos.scalar_type() == at::kLong &&
          excluded_valid.sizes() == excluded_pos.sizes() &&
          excluded_valid.scalar_type() == at::kBool,
      op, ": excluded_pos must be (B, Hkv, E) int64 and excluded_valid bool of its shape");
}

// The checks guard the kernel's reads and writes; merge_cpu.py's _check_merge states the
// whole contract.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_segments(
    const at::Tensor &rows_in, const at::Tensor &row_max_in, const at::Tensor &row_sum_in,
    const at::Tensor &lowbit_out_in, const at::Tensor &fetched_k, const at::Tensor &fetched_v,
    const at::Tensor &fetched_valid_in, const at::Tensor &window_k, const at::Tensor &window_v,
    const at::Tensor &window_len_in, const at::Tensor &new_k, const at::Tensor &new_v) {
  TORCH_CHECK(merge_kernel, "merge_segments: the C kernel was not handed over");
  TORCH_CHECK_VALUE(rows_in.dim() == 4 && rows_in.scalar_type() == at::kFloat,
                    "merge_segments: rows must be (B, Hkv, M, D) float32");
  const int64_t b = rows_in.size(0), h = rows_in.size(1), m = rows_in.size(2), d = rows_in.size(3);
  TORCH_CHECK_VALUE(m >= 1 && d >= 1, "merge_segments: need M >= 1 and D >= 1");
  for (const at::Tensor *x : {&row_max_in, &row_sum_in})
    TORCH_CHECK_VALUE(x->sizes() == at::IntArrayRef({b, h, m}) && x->scalar_type() == at::kFloat,
                      "merge_segments: row_max and row_sum must be (B, Hkv, M) float32");
  TORCH_CHECK_VALUE(
      lowbit_out_in.sizes() == rows_in.sizes() && lowbit_out_in.scalar_type() == at::kFloat,
      "merge_segments: lowbit_out must be (B, Hkv, M, D) float32");
  const at::Tensor *keys[3] = {&fetched_k, &window_k, &new_k},
                   *values[3] = {&fetched_v, &window_v, &new_v};
  at::Tensor k[3], v[3];
  for (int i = 0; i < 3; i++) {
    const auto dtype = keys[i]->scalar_type();
    TORCH_CHECK_VALUE(keys[i]->dim() == 4 && keys[i]->size(0) == b && keys[i]->size(1) == h &&
                          keys[i]->size(3) == d &&
                          (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                          values[i]->sizes() == keys[i]->sizes() &&
                          values[i]->scalar_type() == dtype,
                      "merge_segments: each segment's k and v must be (B, Hkv, N, D) float32, "
                      "bfloat16 or float16 alike");
    k[i] = keys[i]->stride(3) == 1 ? *keys[i]
                                   : keys[i]->contiguous();  // positions and heads may be strided
    v[i] = values[i]->stride(3) == 1 ? *values[i] : values[i]->contiguous();
  }
  const int64_t s = new_k.size(2);
  TORCH_CHECK_VALUE(s >= 1 && m % s == 0,
                    "merge_segments: need S >= 1 new pairs and M a multiple of S");
  TORCH_CHECK_VALUE(fetched_valid_in.sizes() == at::IntArrayRef({b, h, fetched_k.size(2)}) &&
                        fetched_valid_in.scalar_type() == at::kBool,
                    "merge_segments: fetched_valid must be (B, Hkv, N) bool");
  TORCH_CHECK_VALUE(window_len_in.dim() == 1 && window_len_in.size(0) == b &&
                        window_len_in.scalar_type() == at::kLong,
                    "merge_segments: window_len must be (B,) int64");
  if (m > 64 ||
      d > 256) {  // more rows or channels than the C kernel's registers hold: the reference
    static const auto reference = plain<decltype(merge_segments)>("merge_segments");
    return reference.call(rows_in, row_max_in, row_sum_in, lowbit_out_in, fetched_k, fetched_v,
                          fetched_valid_in, window_k, window_v, window_len_in, new_k, new_v);
  }
  const at::Tensor rows = rows_in.contiguous(), row_max = row_max_in.contiguous(),
                   row_sum = row_sum_in.contiguous(), lowbit_out = lowbit_out_in.contiguous(),
                   fetched_valid = fetched_valid_in.contiguous(),
                   window_len = window_len_in.contiguous();
  at::Tensor out = at::empty({b, h, m, d}, rows.options()),
             lowbit_scale = at::empty({b, h, m, 1}, rows.options());
  at::Tensor probs[3];
  MergeProblem problem{rows.data_ptr(), row_max.data_ptr(), row_sum.data_ptr(),
                       lowbit_out.data_ptr()};
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
  TORCH_CHECK(merge_kernel(&problem) == 0, "merge_cpu.c rejected a merge that passed the checks");
  return {out, lowbit_scale, probs[0], probs[1], probs[2]};
}

// The low-bit passes' common arguments checked (the checks guard the kernels' reads and writes;
// lowbit_cpu.py's _check states the whole contract) and run by `kernel`; with `kept` given, the
// sparse pass's v_mean and min_weight too, and its kept allocated (else NULL and 0); with
// `block_max` given, each row's largest weight per block written there. nullopt for a shape the
// C kernels do not take.
std::optional<LowbitOutputs> run_lowbit(
    LowbitKernel kernel, const char *name, const at::Tensor &rows_in, const at::Tensor &k_packed_in,
    const at::Tensor &k_scale_in, const at::Tensor &k_zero_in, const at::Tensor &v_packed_in,
    const at::Tensor &v_scale_in, const at::Tensor &v_zero_in, int64_t bits, int64_t group,
    const at::Tensor &visible_len_in, const at::Tensor &excluded_pos_in,
    const at::Tensor &excluded_valid_in, const at::Tensor *v_mean_in = nullptr,
    double min_weight = 0.0, at::Tensor *kept = nullptr, float *block_max = nullptr) {
  TORCH_CHECK(kernel, name, ": the C kernel was not handed over");
  TORCH_CHECK_VALUE(rows_in.dim() == 4 && rows_in.scalar_type() == at::kFloat,
                    "lowbit_partial_attention: rows must be (B, Hkv, M, D) float32");
  const int64_t b = rows_in.size(0), h = rows_in.size(1), m = rows_in.size(2), d = rows_in.size(3);
  TORCH_CHECK_VALUE(b >= 1 && h >= 1, "lowbit_partial_attention: need B and Hkv >= 1");
  TORCH_CHECK_VALUE(bits == 1 || bits == 2, "lowbit_partial_attention: bits must be 1 or 2");
  TORCH_CHECK_VALUE(group > 0, "lowbit_partial_attention: the group must be positive");
  TORCH_CHECK_VALUE(k_packed_in.dim() == 4 && k_packed_in.size(2) > 0,
                    "lowbit_partial_attention: k_packed must be (B, Hkv, T > 0, D*bits/8)");
  const int64_t t = k_packed_in.size(2), nbytes = d * bits / 8, groups = (t + group - 1) / group;
  const int64_t value_groups = v_scale_in.dim() == 4 ? v_scale_in.size(3) : 0;
  TORCH_CHECK_VALUE(
      value_groups > 0 && d % value_groups == 0 && d / value_groups == std::min<int64_t>(group, d),
      "lowbit_partial_attention: v_scale must be (B, Hkv, T, D / min(group, D))");
  const auto scale_type = k_scale_in.scalar_type();
  TORCH_CHECK_VALUE(scale_type == at::kHalf || scale_type == at::kBFloat16,
                    "lowbit_partial_attention: scales must be float16 or bfloat16");
  const std::pair<const at::Tensor *, std::vector<int64_t>> shapes[] = {
      {&k_packed_in, {b, h, t, nbytes}},      {&v_packed_in, {b, h, t, nbytes}},
      {&k_scale_in, {b, h, groups, d}},       {&k_zero_in, {b, h, groups, d}},
      {&v_scale_in, {b, h, t, value_groups}}, {&v_zero_in, {b, h, t, value_groups}}};
  for (const auto &[x, shape] : shapes)
    TORCH_CHECK_VALUE(
        x->sizes() == at::IntArrayRef(shape) &&
            x->scalar_type() == (x == &k_packed_in || x == &v_packed_in ? at::kByte : scale_type),
        "lowbit_partial_attention: the low-bit copy's tensors do not have specache/lowbit.py's "
        "layout");
  TORCH_CHECK_VALUE(visible_len_in.dim() == 1 && visible_len_in.size(0) == b &&
                        visible_len_in.scalar_type() == at::kLong,
                    "lowbit_partial_attention: visible_len must be (B,) int64");
  check_exclusions("lowbit_partial_attention", excluded_pos_in, excluded_valid_in, b, h);
  if (kept)
    TORCH_CHECK_VALUE(v_mean_in->sizes() == at::IntArrayRef({b, h, groups, d}) &&
                          v_mean_in->scalar_type() == scale_type,
                      name, ": v_mean must be (B, Hkv, ceil(T / group), D) in the scales' dtype");
  // a shape the C kernels do not take: the caller's reference
  if (!(d % 16 == 0 && d >= 16 && d <= 256 && group % 8 == 0 && group <= (1 << 20))) return {};
  const at::Tensor rows = rows_in.contiguous(), k_packed = k_packed_in.contiguous(),
                   v_packed = v_packed_in.contiguous(), k_scale = k_scale_in.contiguous(),
                   k_zero = k_zero_in.contiguous(), v_scale = v_scale_in.contiguous(),
                   v_zero = v_zero_in.contiguous(), visible_len = visible_len_in.contiguous(),
                   excluded_pos = excluded_pos_in.contiguous(),
                   excluded_valid = excluded_valid_in.contiguous();
  at::Tensor weights = at::empty({b, h, m, t}, rows.options()),
             row_max = at::empty({b, h, m}, rows.options());
  at::Tensor row_sum = at::empty({b, h, m}, rows.options()),
             out = at::empty({b, h, m, d}, rows.options());
  LowbitProblem problem{rows.data_ptr(),
                              k_packed.data_ptr(),
                              v_packed.data_ptr(),
                              k_scale.data_ptr(),
                              k_zero.data_ptr(),
                              v_scale.data_ptr(),
                              v_zero.data_ptr(),
                              visible_len.data_ptr(),
                              excluded_pos.data_ptr(),
                              excluded_valid.data_ptr(),
                              weights.data_ptr(),
                              row_max.data_ptr(),
                              row_sum.data_ptr(),
                              out.data_ptr(),
                              b,
                              h,
                              m,
                              d,
                              t,
                              excluded_pos.size(2),
                              static_cast<int32_t>(bits),
                              static_cast<int32_t>(group),
                              static_cast<int32_t>(value_groups),
                              scale_type == at::kBFloat16 ? 1 : 0,
                              static_cast<int32_t>(at::get_num_threads())};
  at::Tensor v_mean;  // alive through the call
  if (kept) {
    v_mean = v_mean_in->contiguous();
    *kept = at::empty({b, h, t}, excluded_valid.options());
    problem.v_mean = v_mean.data_ptr();
    problem.kept = kept->data_ptr();
    problem.min_weight = min_weight;
  }
  problem.block_max = block_max;
  TORCH_CHECK(kernel(&problem) == 0, name,
              ": the C kernel rejected a problem that passed the checks");
  return LowbitOutputs{weights, row_max, row_sum, out};
}

}  // namespace

// Integer: specache::lowbit_partial_attention_int8, the same contract with lowbit_int_cpu.c.
template <bool integer>
LowbitOutputs lowbit_partial_attention(
    const at::Tensor &rows, const at::Tensor &k_packed, const at::Tensor &k_scale,
    const at::Tensor &k_zero, const at::Tensor &v_packed, const at::Tensor &v_scale,
    const at::Tensor &v_zero, int64_t bits, int64_t group, const at::Tensor &visible_len,
    const at::Tensor &excluded_pos, const at::Tensor &excluded_valid) {
  const char *name = integer ? "lowbit_partial_attention_int8" : "lowbit_partial_attention";
  const std::optional<LowbitOutputs> outputs =
      run_lowbit(integer ? lowbit_int8_kernel : lowbit_kernel, name, rows, k_packed, k_scale,
                 k_zero, v_packed, v_scale, v_zero, bits, group, visible_len, excluded_pos,
                 excluded_valid);
  if (outputs) return *outputs;
  static const auto reference = plain<decltype(lowbit_partial_attention<integer>)>(name);
  return reference.call(rows, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, bits, group,
                        visible_len, excluded_pos, excluded_valid);
}

// specache::lowbit_partial_attention_sparse: the same contract with v_mean, lowbit_sparse_cpu.c.
SparseOutputs lowbit_partial_attention_sparse(
    const at::Tensor &rows, const at::Tensor &k_packed, const at::Tensor &k_scale,
    const at::Tensor &k_zero, const at::Tensor &v_packed, const at::Tensor &v_scale,
    const at::Tensor &v_zero, const at::Tensor &v_mean, int64_t bits, int64_t group,
    double min_weight, const at::Tensor &visible_len, const at::Tensor &excluded_pos,
    const at::Tensor &excluded_valid) {
  const char *name = "lowbit_partial_attention_sparse";
  at::Tensor kept;
  const std::optional<LowbitOutputs> outputs =
      run_lowbit(lowbit_sparse_kernel, name, rows, k_packed, k_scale, k_zero, v_packed, v_scale,
                 v_zero, bits, group, visible_len, excluded_pos, excluded_valid, &v_mean,
                 min_weight, &kept);
  if (outputs) {
    const auto &[weights, row_max, row_sum, out] = *outputs;
    return {weights, row_max, row_sum, out, kept};
  }
  static const auto reference = plain<decltype(lowbit_partial_attention_sparse)>(name);
  return reference.call(rows, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, v_mean, bits,
                        group, min_weight, visible_len, excluded_pos, excluded_valid);
}

std::optional<LowbitOutputs> lowbit_pass_for_step(
    int64_t arithmetic, const at::Tensor &rows, const at::Tensor &k_packed,
    const at::Tensor &k_scale, const at::Tensor &k_zero, const at::Tensor &v_packed,
    const at::Tensor &v_scale, const at::Tensor &v_zero, const at::Tensor *v_mean, int64_t bits,
    int64_t group, double min_weight, const at::Tensor &visible_len,
    const at::Tensor &excluded_pos, const at::Tensor &excluded_valid, float *block_max) {
  const LowbitKernel kernels[] = {lowbit_kernel, lowbit_int8_kernel, lowbit_sparse_kernel};
  const char *names[] = {"lowbit_partial_attention", "lowbit_partial_attention_int8",
                         "lowbit_partial_attention_sparse"};
  at::Tensor kept;  // the sparse pass writes it; the step has no use for it
  return run_lowbit(kernels[arithmetic], names[arithmetic], rows, k_packed, k_scale, k_zero,
                    v_packed, v_scale, v_zero, bits, group, visible_len, excluded_pos,
                    excluded_valid, arithmetic == 2 ? v_mean : nullptr, min_weight,
                    arithmetic == 2 ? &kept : nullptr, block_max);
}

template std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lowbit_partial_attention<false>(
    const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &,
    const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, int64_t,
    const at::Tensor &, const at::Tensor &, const at::Tensor &);
template std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lowbit_partial_attention<true>(
    const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &,
    const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, int64_t,
    const at::Tensor &, const at::Tensor &, const at::Tensor &);

namespace {

// The checks guard the kernel's reads and writes; rank_cpu.py's _check states the whole
// contract.
std::tuple<at::Tensor, at::Tensor> top_positions(
    const at::Tensor &weights_in, const at::Tensor &scale_in, const at::Tensor &p_fetched_in,
    const at::Tensor &fetched_pos_in, const at::Tensor &p_window_in,
    const at::Tensor &window_start_in, int64_t s, int64_t row, bool gqa_max, int64_t lower,
    const at::Tensor &upper_in, const at::Tensor &excluded_pos_in,
    const at::Tensor &excluded_valid_in, int64_t k) {
  TORCH_CHECK(rank_kernel, "top_positions: the C kernel was not handed over");
  TORCH_CHECK_VALUE(weights_in.dim() == 4 && weights_in.scalar_type() == at::kFloat,
                    "top_positions: weights must be (B, Hkv, M, T) float32");
  const int64_t b = weights_in.size(0), h = weights_in.size(1), m = weights_in.size(2),
                t = weights_in.size(3);
  TORCH_CHECK_VALUE(
      b >= 1 && h >= 1 && s >= 1 && m >= s && m % s == 0 && row >= 0 && row < s && k >= 0,
      "top_positions: need B, Hkv >= 1, M a positive multiple of S, 0 <= row < S, k >= 0");
  TORCH_CHECK_VALUE(scale_in.numel() == b * h * m && scale_in.dim() >= 3 && scale_in.size(0) == b &&
                        scale_in.size(1) == h && scale_in.size(2) == m &&
                        scale_in.scalar_type() == at::kFloat,
                    "top_positions: scale must be (B, Hkv, M) float32");
  for (const at::Tensor *x : {&p_fetched_in, &p_window_in})
    TORCH_CHECK_VALUE(x->dim() == 4 && x->size(0) == b && x->size(1) == h && x->size(2) == m &&
                          x->scalar_type() == at::kFloat,
                      "top_positions: p_fetched and p_window must be (B, Hkv, M, N) float32");
  TORCH_CHECK_VALUE(fetched_pos_in.dim() == 3 && fetched_pos_in.size(0) == b &&
                        fetched_pos_in.size(1) == h &&
                        fetched_pos_in.size(2) == p_fetched_in.size(3) &&
                        fetched_pos_in.scalar_type() == at::kLong,
                    "top_positions: fetched_pos must be (B, Hkv, K) int64");
  for (const at::Tensor *x : {&window_start_in, &upper_in})
    TORCH_CHECK_VALUE(x->dim() == 1 && x->size(0) == b && x->scalar_type() == at::kLong,
                      "top_positions: window_start and upper must be (B,) int64");
  check_exclusions("top_positions", excluded_pos_in, excluded_valid_in, b, h);
  const at::Tensor weights = weights_in.contiguous(), scale = scale_in.contiguous(),
                   p_fetched = p_fetched_in.contiguous(), fetched_pos = fetched_pos_in.contiguous(),
                   p_window = p_window_in.contiguous(), window_start = window_start_in.contiguous(),
                   upper = upper_in.contiguous(), excluded_pos = excluded_pos_in.contiguous(),
                   excluded_valid = excluded_valid_in.contiguous();
  at::Tensor indices = at::empty({b, h, k}, fetched_pos.options());
  at::Tensor valid = at::empty({b, h, k}, excluded_valid.options());
  const RankProblem problem{weights.data_ptr(),
                            scale.data_ptr(),
                            p_fetched.data_ptr(),
                            fetched_pos.data_ptr(),
                            p_window.data_ptr(),
                            window_start.data_ptr(),
                            upper.data_ptr(),
                            excluded_pos.data_ptr(),
                            excluded_valid.data_ptr(),
                            indices.data_ptr(),
                            valid.data_ptr(),
                            b,
                            h,
                            m,
                            t,
                            p_fetched.size(3),
                            p_window.size(3),
                            excluded_pos.size(2),
                            k,
                            lower,
                            static_cast<int32_t>(s),
                            static_cast<int32_t>(row),
                            gqa_max ? 1 : 0,
                            static_cast<int32_t>(at::get_num_threads())};
  TORCH_CHECK(rank_kernel(&problem) == 0, "rank_cpu.c rejected a problem that passed the checks");
  return {indices, valid};
}

// The op `name`'s C kernel is at `address`, and its Problem struct is `problem_bytes` long: keep
// it and register the C++ implementation for CPU tensors.
void set_cpu_kernel(const std::string &name, int64_t address, int64_t problem_bytes) {
  TORCH_CHECK(address != 0, "set_cpu_kernel: a null address");
  const char *op = name.c_str();
  if (name == "merge_segments")
    hand_over("specache", merge_kernel, address, op, &merge_segments, problem_bytes);
  else if (name == "top_positions")
    hand_over("specache", rank_kernel, address, op, &top_positions, problem_bytes);
  else if (name == "lowbit_partial_attention")
    hand_over("specache", lowbit_kernel, address, op, &lowbit_partial_attention<false>,
              problem_bytes);
  else if (name == "lowbit_partial_attention_int8")
    hand_over("specache", lowbit_int8_kernel, address, op, &lowbit_partial_attention<true>,
              problem_bytes);
  else if (name == "lowbit_partial_attention_sparse")
    hand_over("specache", lowbit_sparse_kernel, address, op, &lowbit_partial_attention_sparse,
              problem_bytes);
  else
    TORCH_CHECK(false, "set_cpu_kernel: no C++ implementation of ", name);
}

}  // namespace
}  // namespace specache_cpu

TORCH_LIBRARY_FRAGMENT(specache, m) {
  m.def("set_cpu_kernel(str name, int address, int problem_bytes) -> ()",
        &specache_cpu::set_cpu_kernel);
  m.def("enable_step_attention() -> bool", &specache_cpu::enable_step_attention);
}
