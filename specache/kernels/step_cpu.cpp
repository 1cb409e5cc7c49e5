// specache::step_attention: a layer's whole attention in a decode step, its slow tier in the same
// RAM (specache/step.py's step_attention_reference states it). The low-bit pass runs over all KV
// heads (its kernel splits the positions among the threads); everything else, small beside it,
// runs KV head by KV head on the C kernels that cpu_ops.cpp dispatches: the merge, the real row's
// ranking (with a shortlist, the exact scores of the pairs it lists and their ranking), its picks'
// gather into the slots and their drop from the low-bit sums, the merge again, the last row's
// ranking and the prefetch's gather. Before them, the check of the prefetch (correct); after, the
// count of the pairs read (the prefetch's less those the previous one held, with reuse): what the
// layer did in Python around the op, a dozen small ops of eager dispatch each. Shapes the kernels
// do not take go to the reference.

#include <ATen/ops/zeros.h>

#include "cpu_ops.h"

namespace specache_cpu {
namespace {

constexpr float kDropRounding = 1e-5f;  // specache/select.py's DROP_ROUNDING
constexpr int64_t kPrefetchAhead = 8;   // listed keys the shortlist's scoring asks for ahead

// A query row times a key, float32, d a multiple of 8: eight partial sums, which the compiler
// keeps in one vector register.
float dot(const float *row, const float *key, int64_t d) {
  float partial[8] = {};
  for (int64_t c = 0; c < d; c += 8)
    for (int j = 0; j < 8; j++) partial[j] += row[c + j] * key[c + j];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// key[0, d) <- pairs[0, d) in float32.
template <typename Pair>
void widen(const Pair *pairs, int64_t d, float *key) {
  for (int64_t c = 0; c < d; c++) key[c] = static_cast<float>(pairs[c]);
}

using StepResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                              at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// correct (specache/select.py's prefetch_missed): (B, Hkv) bool, the KV heads whose real rows'
// mean cosine (over the head's query heads) to the rows that chose the prefetch is below
// `threshold`; each vector divided by its norm (at least 1e-8) first, as F.cosine_similarity does.
at::Tensor prefetch_missed(const at::Tensor &rows, const at::Tensor &last_query, int64_t s,
                           double threshold) {
  const int64_t b = rows.size(0), h = rows.size(1), m = rows.size(2), d = rows.size(3),
                query_heads = m / s;
  at::Tensor discard = at::empty({b, h}, rows.options().dtype(at::kBool));
  const float *row = rows.data_ptr<float>(), *previous = last_query.data_ptr<float>();
  for (int64_t bh = 0; bh < b * h; bh++) {
    float total = 0.0f;
    for (int64_t g = 0; g < query_heads; g++) {
      const float *x = row + (bh * m + g * s) * d, *y = previous + (bh * query_heads + g) * d;
      float xx = 0.0f, yy = 0.0f;
      for (int64_t c = 0; c < d; c++) {
        xx += x[c] * x[c];
        yy += y[c] * y[c];
      }
      const float x_norm = std::max(std::sqrt(xx), 1e-8f),
                  y_norm = std::max(std::sqrt(yy), 1e-8f);
      float cosine = 0.0f;
      for (int64_t c = 0; c < d; c++) cosine += (x[c] / x_norm) * (y[c] / y_norm);
      total += cosine;
    }
    const float mean = total / static_cast<float>(query_heads);
    discard.data_ptr<bool>()[bh] = mean < static_cast<float>(threshold);
  }
  return discard;
}

StepResult step_attention(
    const at::Tensor &rows_in, const at::Tensor &k_packed, const at::Tensor &k_scale,
    const at::Tensor &k_zero, const at::Tensor &v_packed_in, const at::Tensor &v_scale_in,
    const at::Tensor &v_zero_in, const std::optional<at::Tensor> &v_mean_in, int64_t bits,
    int64_t group, int64_t arithmetic, double min_weight, const at::Tensor &quantized_len_in,
    const at::Tensor &fetched_k, const at::Tensor &fetched_v,
    const at::Tensor &fetched_pos, const at::Tensor &fetched_valid, const at::Tensor &window_k_in,
    const at::Tensor &window_v_in, const at::Tensor &window_len_in, const at::Tensor &new_k_in,
    const at::Tensor &new_v_in, const at::Tensor &store_k_in, const at::Tensor &store_v_in,
    int64_t n_picks, int64_t shortlist, const std::optional<at::Tensor> &last_query_in,
    double correct_below, bool gqa_max, int64_t n_sinks, int64_t n_spec,
    const at::Tensor &selectable_len_in, const at::Tensor &held_pos_in,
    const at::Tensor &held_valid_in, bool reuse) {
  const int64_t b = rows_in.size(0), h = rows_in.size(1),
                m = rows_in.dim() == 4 ? rows_in.size(2) : 0,
                d = rows_in.dim() == 4 ? rows_in.size(3) : 0,
                t = k_packed.dim() == 4 ? k_packed.size(2) : 0;
  const int64_t slots = fetched_k.dim() == 4 ? fetched_k.size(2) : -1,
                s = new_k_in.dim() == 4 ? new_k_in.size(2) : 0;
  const auto pair_type = fetched_k.scalar_type();
  // the real row's candidates: its picks, or the shortlist's list of n x as many (at most T)
  const int64_t n_listed =
      shortlist > 0 && n_picks > 0 ? std::min(n_picks * shortlist, t) : n_picks;
  // arithmetic indexes specache.config.ARITHMETICS: float, int8, sparse
  const LowbitKernel passes[] = {lowbit_kernel, lowbit_int8_kernel, lowbit_sparse_kernel};
  bool fusable =
      arithmetic >= 0 && arithmetic <= 2 && passes[arithmetic] &&
      (arithmetic != 2 || v_mean_in.has_value()) && merge_kernel && rank_kernel &&
      rows_in.dim() == 4 && rows_in.scalar_type() == at::kFloat && t > 0 && m >= 1 && m <= 64 &&
      s >= 1 && m % s == 0 && d % 16 == 0 && d >= 16 && d <= 256 && group % 8 == 0 &&
      group <= (1 << 20) && (bits == 1 || bits == 2) && n_picks >= 0 && shortlist >= 0 &&
      n_listed >= n_picks &&
      n_spec >= 0 && n_sinks >= 0 && n_sinks + n_spec <= slots &&
      // else it raises
      (n_picks == 0 || n_picks >= slots - n_sinks - (last_query_in ? 0 : n_spec)) &&
      v_packed_in.dim() == 4 && v_scale_in.dim() == 4 && v_scale_in.size(3) > 0 &&
      d % v_scale_in.size(3) == 0 && quantized_len_in.dim() == 1 && quantized_len_in.size(0) == b &&
      quantized_len_in.scalar_type() == at::kLong &&
      selectable_len_in.sizes() == quantized_len_in.sizes() &&
      selectable_len_in.scalar_type() == at::kLong &&
      (!last_query_in || (last_query_in->sizes() == at::IntArrayRef({b, h * (m / s), d}) &&
                          last_query_in->scalar_type() == at::kFloat)) &&
      held_pos_in.dim() == 3 && held_pos_in.size(0) == b && held_pos_in.size(1) == h &&
      held_pos_in.scalar_type() == at::kLong && held_valid_in.sizes() == held_pos_in.sizes() &&
      held_valid_in.scalar_type() == at::kBool;
  const at::Tensor *pairs[] = {&fetched_v, &window_k_in, &window_v_in, &new_k_in,
                               &new_v_in,  &store_k_in,  &store_v_in};
  // the gathers copy whole pairs: the slots, the window and the tier in one dtype
  for (const at::Tensor *x : pairs)
    fusable = fusable && x->dim() == 4 && x->size(0) == b && x->size(1) == h && x->size(3) == d &&
              (x->scalar_type() == pair_type || (x == &new_k_in || x == &new_v_in));
  const auto new_type = new_k_in.scalar_type();
  fusable = fusable && new_v_in.scalar_type() == new_type &&
            (new_type == at::kFloat || new_type == at::kBFloat16 || new_type == at::kHalf);
  fusable = fusable && fetched_v.sizes() == fetched_k.sizes() &&
            store_v_in.sizes() == store_k_in.sizes() &&
            window_v_in.sizes() == window_k_in.sizes() && new_v_in.sizes() == new_k_in.sizes() &&
            store_k_in.size(2) >= 1 && window_len_in.sizes() == quantized_len_in.sizes() &&
            window_len_in.scalar_type() == at::kLong &&
            fetched_pos.sizes() == at::IntArrayRef({b, h, slots}) &&
            fetched_pos.scalar_type() == at::kLong &&
            fetched_valid.sizes() == fetched_pos.sizes() &&
            fetched_valid.scalar_type() == at::kBool &&
            (pair_type == at::kFloat || pair_type == at::kBFloat16 || pair_type == at::kHalf);
  if (!fusable) {
    static const auto reference = plain<decltype(step_attention)>("step_attention");
    return reference.call(rows_in, k_packed, k_scale, k_zero, v_packed_in, v_scale_in, v_zero_in,
                          v_mean_in, bits, group, arithmetic, min_weight, quantized_len_in,
                          fetched_k, fetched_v, fetched_pos, fetched_valid, window_k_in,
                          window_v_in, window_len_in, new_k_in, new_v_in, store_k_in, store_v_in,
                          n_picks, shortlist, last_query_in, correct_below, gqa_max, n_sinks,
                          n_spec, selectable_len_in, held_pos_in, held_valid_in, reuse);
  }
  const at::Tensor rows = rows_in.contiguous(), quantized_len = quantized_len_in.contiguous(),
                   selectable_len = selectable_len_in.contiguous(),
                   store_k = store_k_in.contiguous(), store_v = store_v_in.contiguous(),
                   v_packed = v_packed_in.contiguous(), v_scale = v_scale_in.contiguous(),
                   v_zero = v_zero_in.contiguous();
  const at::Tensor discard =
      last_query_in ? prefetch_missed(rows, last_query_in->contiguous(), s, correct_below)
                    : at::Tensor();
  const at::Tensor held_pos = held_pos_in.contiguous(), held_valid = held_valid_in.contiguous();
  const int64_t n_held = held_pos.size(2);
  const int64_t *qlen = quantized_len.data_ptr<int64_t>();
  // exact_slots: the slots that count, and the low-bit pass leaves out
  at::Tensor exact = fetched_valid.contiguous().clone();
  at::Tensor out_pos = fetched_pos.contiguous().clone(),
             out_valid = fetched_valid.contiguous().clone();
  {
    bool *ex = exact.data_ptr<bool>();
    const int64_t *pos = out_pos.data_ptr<int64_t>();
    for (int64_t bh = 0; bh < b * h; bh++)
      for (int64_t j = 0; j < slots; j++) {
        const bool dropped = j >= n_sinks + n_spec ||
                             (j >= n_sinks && discard.defined() && discard.data_ptr<bool>()[bh]);
        ex[bh * slots + j] = ex[bh * slots + j] && pos[bh * slots + j] < qlen[bh / h] && !dropped;
      }
  }
  // each row's largest low-bit weight per block of 64 positions: the rankings skip the blocks
  // that cannot hold a choice (rank_cpu.c's rank_bounded)
  const int64_t n_blocks = (t + 63) / 64;
  at::Tensor block_max = at::empty({b, h, m, n_blocks}, rows.options());
  std::optional<LowbitOutputs> pass = lowbit_pass_for_step(
      arithmetic, rows, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero,
      v_mean_in ? &*v_mean_in : nullptr, bits, group, min_weight, quantized_len, out_pos, exact,
      block_max.data_ptr<float>());
  TORCH_CHECK(pass, "step_attention: the low-bit kernel refused a shape the step let through");
  auto [weights, row_max, row_sum, lowbit_out] = *pass;
  TORCH_CHECK(weights.is_contiguous() && row_max.is_contiguous() && row_sum.is_contiguous() &&
                  lowbit_out.is_contiguous(),
              "step_attention: the low-bit pass returned strided tensors");
  at::Tensor out_k = fetched_k.contiguous().clone(), out_v = fetched_v.contiguous().clone();
  const at::Tensor window_k = window_k_in.stride(3) == 1 ? window_k_in : window_k_in.contiguous(),
                   window_v = window_v_in.stride(3) == 1 ? window_v_in : window_v_in.contiguous(),
                   new_k = new_k_in.stride(3) == 1 ? new_k_in : new_k_in.contiguous(),
                   new_v = new_v_in.stride(3) == 1 ? new_v_in : new_v_in.contiguous(),
                   window_len = window_len_in.contiguous();
  const at::Tensor *keys[3] = {&out_k, &window_k, &new_k}, *values[3] = {&out_v, &window_v, &new_v};
  at::Tensor out = at::empty({b, h, m, d}, rows.options()),
             lowbit_scale = at::empty({b, h, m}, rows.options());
  at::Tensor probs[3];
  for (int i = 0; i < 3; i++) probs[i] = at::empty({b, h, m, keys[i]->size(2)}, rows.options());
  at::Tensor picks = at::empty({b, h, n_picks}, out_pos.options()),
             picked = at::empty({b, h, n_picks}, exact.options());
  at::Tensor placed = at::empty({b, h, n_picks}, exact.options());
  at::Tensor listed = shortlist ? at::empty({b, h, n_listed}, out_pos.options()) : picks;
  at::Tensor listed_valid = shortlist ? at::empty({b, h, n_listed}, exact.options()) : picked;
  // the pairs each KV head reads for its picks
  at::Tensor read = at::zeros({b, h}, out_pos.options());
  at::Tensor kappa_pos = at::empty({b, h, n_spec}, out_pos.options()),
             kappa_valid = at::empty({b, h, n_spec}, exact.options());
  const int64_t store_t = store_k.size(2), pair_bytes = d * store_k.element_size(),
                window = window_k.size(2);
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
      p.k[i] = static_cast<const char *>(keys[i]->data_ptr()) +
               (bi * keys[i]->stride(0) + hi * keys[i]->stride(1)) * size;
      p.v[i] = static_cast<const char *>(values[i]->data_ptr()) +
               (bi * values[i]->stride(0) + hi * values[i]->stride(1)) * size;
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
  auto rank_head = [&](int64_t bh, int64_t bi, int64_t row, int64_t lower, const int64_t *upper,
                       int64_t n_excluded, int64_t k, int64_t *indices, bool *valid) {
    const RankProblem p{weights.data_ptr<float>() + bh * m * t,
                        lowbit_scale.data_ptr<float>() + bh * m,
                        probs[0].data_ptr<float>() + bh * m * slots,
                        out_pos.data_ptr<int64_t>() + bh * slots,
                        probs[1].data_ptr<float>() + bh * m * window,
                        qlen + bi,
                        upper,
                        out_pos.data_ptr<int64_t>() + bh * slots,
                        exact.data_ptr<bool>() + bh * slots,
                        indices,
                        valid,
                        1,
                        1,
                        m,
                        t,
                        slots,
                        window,
                        n_excluded,
                        k,
                        lower,
                        static_cast<int32_t>(s),
                        static_cast<int32_t>(row),
                        gqa_max ? 1 : 0,
                        1,
                        block_max.data_ptr<float>() + bh * m * n_blocks};
    return rank_kernel(&p);
  };
  // slot <- the tier's pair at position
  auto copy_pair = [&](int64_t bh, int64_t slot, int64_t position) {
    const int64_t at_pos = std::min(std::max<int64_t>(position, 0), store_t - 1);
    const int64_t from = (bh * store_t + at_pos) * pair_bytes,
                  to = (bh * slots + slot) * pair_bytes;
    std::memcpy(static_cast<char *>(out_k.data_ptr()) + to,
                static_cast<const char *>(store_k.data_ptr()) + from, pair_bytes);
    std::memcpy(static_cast<char *>(out_v.data_ptr()) + to,
                static_cast<const char *>(store_v.data_ptr()) + from, pair_bytes);
  };
  // drop_from_lowbit: the placed picks' weights leave the low-bit sums, and their weighted values
  // its output
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
      // else what is left is noise
      const bool left = sum[row] - dropped_sum[row] > sum[row] * kDropRounding;
      sum[row] = left ? sum[row] - dropped_sum[row] : 0.0f;
      for (int64_t c = 0; c < d; c++)
        acc[row * d + c] = left ? acc[row * d + c] - dropped_out[row * d + c] : 0.0f;
    }
  };
  // the tier's key at position, in float32, into key
  const void *tier_keys = store_k.data_ptr();
  const int64_t key_bytes = store_k.element_size();
  auto key_offset = [&](int64_t bh, int64_t position) {
    return (bh * store_t + std::min(std::max<int64_t>(position, 0), store_t - 1)) * d;
  };
  auto key_at = [&](int64_t bh, int64_t position, float *key) {
    const int64_t offset = key_offset(bh, position);
    if (pair_type == at::kFloat)
      std::memcpy(key, static_cast<const float *>(tier_keys) + offset, d * sizeof(float));
    else if (pair_type == at::kBFloat16)
      widen(static_cast<const at::BFloat16 *>(tier_keys) + offset, d, key);
    else
      widen(static_cast<const at::Half *>(tier_keys) + offset, d, key);
  };
  // shortlist (specache/select.py's rank_shortlist): of the listed candidates, the n_picks whose
  // exact keys weigh most, as exp(score - the low-bit row max) x the low-bit scale (the copy's own
  // measure), max or mean over query heads
  const int64_t query_heads = m / s;
  auto shortlist_head = [&](int64_t bh, const int64_t *candidates, const bool *listed_ok,
                            int64_t *index, bool *valid) {
    const float *row = rows.data_ptr<float>() + bh * m * d,
                *max = row_max.data_ptr<float>() + bh * m;
    const float *scale = lowbit_scale.data_ptr<float>() + bh * m;
    std::vector<float> weight(n_listed, -1.0f);  // -1: not listed
    std::vector<int64_t> order(n_listed);
    std::vector<float> key(d);
    for (int64_t i = 0; i < n_listed; i++) {
      order[i] = i;
      // the listed keys lie anywhere in the tier: the key kPrefetchAhead places on is brought
      // into the cache while this one is scored, so that their misses overlap
      if (i + kPrefetchAhead < n_listed && listed_ok[i + kPrefetchAhead]) {
        const char *ahead = static_cast<const char *>(tier_keys) +
                            key_offset(bh, candidates[i + kPrefetchAhead]) * key_bytes;
        for (int64_t line = 0; line < d * key_bytes; line += 64) __builtin_prefetch(ahead + line);
      }
      if (!listed_ok[i]) continue;
      key_at(bh, candidates[i], key.data());
      float most = 0.0f, total = 0.0f;
      for (int64_t g = 0; g < query_heads; g++) {  // the real row of each query head
        const int64_t r = g * s;
        // clamped: far above the copy's largest it would overflow, and inf x a scale of 0 is NaN
        const float w =
            std::exp(std::min(dot(row + r * d, key.data(), d) - max[r], 60.0f)) * scale[r];
        most = std::max(most, w);
        total += w;
      }
      weight[i] = gqa_max ? most : total / static_cast<float>(query_heads);
    }
    // the listed first, sorted (std::partial_sort over them alone), then the others in list
    // order: where a sort of all by (weight, list order) puts them, at -1
    const auto listed_end = std::stable_partition(
        order.begin(), order.end(), [&](int64_t i) { return weight[i] >= 0.0f; });
    std::partial_sort(order.begin(),
                      order.begin() + std::min<int64_t>(n_picks, listed_end - order.begin()),
                      listed_end, [&](int64_t x, int64_t y) {
                        return weight[x] > weight[y] || (weight[x] == weight[y] && x < y);
                      });
    for (int64_t r = 0; r < n_picks; r++) {
      index[r] = candidates[order[r]];
      valid[r] = weight[order[r]] >= 0.0f;
    }
  };
  std::atomic<int> failed{0};
  auto one_head = [&](int64_t bh) {
    const int64_t bi = bh / h, hi = bh % h;
    int64_t *pos = out_pos.data_ptr<int64_t>() + bh * slots;
    bool *ex = exact.data_ptr<bool>() + bh * slots;
    if (n_picks) {
      int64_t *index = picks.data_ptr<int64_t>() + bh * n_picks;
      bool *valid = picked.data_ptr<bool>() + bh * n_picks,
           *fits = placed.data_ptr<bool>() + bh * n_picks;
      // without a shortlist, the candidates are the picks
      int64_t *candidates = listed.data_ptr<int64_t>() + bh * n_listed;
      bool *listed_ok = listed_valid.data_ptr<bool>() + bh * n_listed;
      // a kernel that fails leaves nothing to go on with: this head stops, and the call raises
      // below
      const int64_t first =
          discard.defined() && discard.data_ptr<bool>()[bh] ? n_sinks : n_sinks + n_spec;
      // the shortlist reads n listed per pick the head places, the ranking's best shortlist x
      // n_placed: the same as the best of its n_listed, so it ranks no more
      const int64_t n_placed = std::min(n_picks, std::max<int64_t>(slots - first, 0)),
                    n_ranked = shortlist ? std::min(n_listed, shortlist * n_placed) : n_listed;
      if (merge_head(bh, bi, hi) ||
          rank_head(bh, bi, 0, 0, qlen + bi, slots, n_ranked, candidates, listed_ok))
        return void(failed = 1);
      int64_t &pairs_read = read.data_ptr<int64_t>()[bh];
      if (shortlist) {
        for (int64_t i = 0; i < n_listed; i++) {
          listed_ok[i] = i < n_ranked && listed_ok[i];
          if (i >= n_ranked) candidates[i] = 0;  // as a ranking leaves an entry it did not fill
          pairs_read += listed_ok[i];
        }
        shortlist_head(bh, candidates, listed_ok, index, valid);
      }
      for (int64_t r = 0; r < n_picks; r++) fits[r] = valid[r] && r < slots - first;
      if (!shortlist)
        for (int64_t r = 0; r < n_picks; r++) pairs_read += fits[r];
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
      if (rank_head(bh, bi, s - 1, n_sinks, selectable_len.data_ptr<int64_t>() + bi, 0, n_spec,
                    kappa, real))
        return void(failed = 1);
      bool *valid_out = out_valid.data_ptr<bool>() + bh * slots;
      const int64_t *held = held_pos.data_ptr<int64_t>() + bh * n_held;
      const bool *held_ok = held_valid.data_ptr<bool>() + bh * n_held;
      for (int64_t i = 0; i < n_spec; i++) {
        copy_pair(bh, n_sinks + i, kappa[i]);
        pos[n_sinks + i] = kappa[i];
        valid_out[n_sinks + i] = real[i];
        // read from the tier: every real entry, or with reuse those the previous prefetch did
        // not hold (specache/tiers.py's prefetch_reads)
        bool held_before = false;
        for (int64_t j = 0; reuse && j < n_held; j++)
          held_before |= held_ok[j] && held[j] == kappa[i];
        read.data_ptr<int64_t>()[bh] += real[i] && !held_before;
      }
    }
  };
  // KV heads on threads, even 3 on 2 (SmolLM2): 200 against 245 us a call at 1k, 730 against 850 at
  // 16k, in a step
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; bh++) one_head(bh);
  });
  TORCH_CHECK(!failed, "step_attention: a C kernel rejected a problem that passed the checks");
  const at::Tensor discarded = discard.defined() ? discard : at::zeros({b, h}, exact.options());
  return {out, out_k, out_v, out_pos, out_valid, placed, kappa_pos, kappa_valid, read, discarded};
}

}  // namespace

// specache::step_attention's C++ implementation, for CPU tensors, once the kernels it runs are
// handed over and cpu_ops.py has registered its reference as specache_plain::step_attention
// (the fallback); false until then.
bool enable_step_attention() {
  static bool registered = false;
  const bool fallback =
      c10::Dispatcher::singleton().findSchema({"specache_plain::step_attention", ""}).has_value();
  if (registered || !(lowbit_kernel && merge_kernel && rank_kernel && fallback)) return registered;
  register_cpu("specache", "step_attention", &step_attention);
  return registered = true;
}

}  // namespace specache_cpu
