// CPU kernels for the decode step (float32, AVX-512): what stock torch leaves on the table
// on a small CPU at decode batch sizes.
//
// - linear: y = x W^T + b over W packed in 48-column blocks ([G, K, 48]). Each block is one
//   sequential stream, so at a handful of rows the kernel reads weights at memory speed, and
//   at 8-64 rows an 8x48 register tile keeps the FMA units busy (MKL's sgemm does neither on
//   this class of CPU). Weights may be packed as bfloat16 (opt-in: half the bytes to stream,
//   widened to float32 in registers; activations and accumulation stay float32).
// - add_rms_norm_ / rms_norm: the residual add and the norm in one pass.
// - rope_: rotary embedding in place on the q and k heads of the fused qkv rows.
// - store_kv / paged_attention: keys and values written to and read from the paged cache in
//   place (no gather of the context), online softmax, the draft-tree mask.
//
// Element-wise results match torch's op by op (fp-contract is off for this file and FMAs are
// used only where a sum is accumulated); reductions run in a different order than torch's.
// The file is compiled for AVX-512 (x86-64-v4); Python imports it only where torch reports
// that capability (seer_engine/model_executor/cpu_kernels.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output columns per zmm register
constexpr int kGroup = 3;       // panels per packed block (one register tile's columns)
constexpr int64_t kBlock = kGroup * kPanel;  // output columns per packed block
constexpr int kRows = 8;        // rows of x per register tile
// Weights are prefetched this far ahead into L2: the hardware prefetcher alone leaves the
// stream ~15% below memory speed at one row, and an L1 prefetch evicts the tile's own data.
constexpr int64_t kPrefetchBytes = 1024;

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
}

// ---------------------------------------------------------------------------------------
// linear

// 16 weights as float32 (stored as float32, or as bfloat16 = its top 16 bits).
inline __m512 load_panel(const float* p) { return _mm512_load_ps(p); }
inline __m512 load_panel(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y[MR, 48] = x[MR, K] @ block (+ bias); `cols` valid output columns (ragged last block).
// The block is [K, 48]: one sequential stream of weights, whatever the row count.
template <int MR, typename W>
void tile(const float* x, int64_t ldx, const W* wb, int64_t K, const float* bias, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[MR][kGroup];
  for (int j = 0; j < kGroup; ++j) {
    __m512 b = bias ? _mm512_loadu_ps(bias + j * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    const W* row = wb + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T1);
    __m512 w[kGroup];
    for (int j = 0; j < kGroup; ++j) w[j] = load_panel(row + j * kPanel);
    for (int m = 0; m < MR; ++m) {
      __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < kGroup; ++j) acc[m][j] = _mm512_fmadd_ps(w[j], xb, acc[m][j]);
    }
  }
  for (int j = 0; j < kGroup; ++j) {
    int64_t left = cols - j * kPanel;
    if (left <= 0) break;
    __mmask16 mask = left >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + j * kPanel, mask, acc[m][j]);
  }
}

template <typename W>
void tile_rows(int64_t rows, const float* x, int64_t ldx, const W* wb, int64_t K, const float* bias, float* y,
               int64_t ldy, int64_t cols) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, wb, K, bias, y, ldy, cols);
    case 2: return tile<2>(x, ldx, wb, K, bias, y, ldy, cols);
    case 3: return tile<3>(x, ldx, wb, K, bias, y, ldy, cols);
    case 4: return tile<4>(x, ldx, wb, K, bias, y, ldy, cols);
    case 5: return tile<5>(x, ldx, wb, K, bias, y, ldy, cols);
    case 6: return tile<6>(x, ldx, wb, K, bias, y, ldy, cols);
    case 7: return tile<7>(x, ldx, wb, K, bias, y, ldy, cols);
    default: return tile<8>(x, ldx, wb, K, bias, y, ldy, cols);
  }
}

// One block against all M rows: the block's weights stay in L2 while the row tiles pass
// over them.
template <typename W>
void linear_block(int64_t g, int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const W* wp,
                  const float* bias, float* y) {
  int64_t cols = std::min<int64_t>(kBlock, N - g * kBlock);
  const W* w = wp + g * K * kBlock;
  const float* b = bias ? bias + g * kBlock : nullptr;
  for (int64_t m = 0; m < M; m += kRows) {
    int64_t rows = std::min<int64_t>(kRows, M - m);
    tile_rows(rows, x + m * ldx, ldx, w, K, b, y + m * N + g * kBlock, N, cols);
  }
}

// [N, K] -> [ceil(N/48), K, 48], zero-padded: each block one contiguous stream for `linear`.
// float32 or bfloat16 (the packed copy keeps the weight's dtype).
template <typename T>
void pack_blocks(const T* src, T* dst, int64_t N, int64_t K, int64_t G) {
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      T* out = dst + g * K * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) {
        int64_t n = g * kBlock + i;
        for (int64_t k = 0; k < K; ++k) out[k * kBlock + i] = n < N ? src[n * K + k] : T(0);
      }
    }
  });
}

torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "pack_weight: weight must be a CPU [out, in] tensor");
  auto w = weight.contiguous();
  int64_t N = w.size(0), K = w.size(1), G = (N + kBlock - 1) / kBlock;
  auto packed = torch::empty({G, K, kBlock}, w.options());
  if (w.scalar_type() == torch::kFloat32) {
    pack_blocks(w.data_ptr<float>(), packed.data_ptr<float>(), N, K, G);
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "pack_weight: float32 or bfloat16 weights, got ", w.scalar_type());
    pack_blocks(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()), N, K, G);
  }
  return packed;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features) {
  check_f32(x, "x");
  bool bf16 = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || packed.scalar_type() == torch::kFloat32, "packed weight must be float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous(),
              "packed weight must be a contiguous [blocks, K, ", kBlock, "] tensor");
  int64_t G = packed.size(0), K = packed.size(1), N = out_features;
  TORCH_CHECK(N > (G - 1) * kBlock && N <= G * kBlock, "out_features ", N, " does not match ", G, " blocks");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  auto x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  int64_t M = x2.size(0), ldx = x2.stride(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == G * kBlock && bias->is_contiguous(), "bias must be padded to ", G * kBlock);
    bp = bias->data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (M == 0) return y;
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // A thread gets at least ~1M multiply-adds (at few rows, ~100 KB of weights to stream):
  // smaller pieces cost more in fork/join than they save.
  int64_t per_block = std::max<int64_t>(M, 4) * K * kBlock;
  int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / per_block);
  if (bf16) {
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) linear_block(g, M, N, K, xp, ldx, wp, bp, yp);
    });
  } else {
    const float* wp = packed.data_ptr<float>();
    at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) linear_block(g, M, N, K, xp, ldx, wp, bp, yp);
    });
  }
  return y;
}

// ---------------------------------------------------------------------------------------
// RMSNorm (as transformers computes it in float32: x * rsqrt(mean(x^2) + eps), then * weight)

inline void norm_row(const float* r, const float* w, float eps, int64_t H, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += r[i] * r[i];
  float inv = 1.f / std::sqrt(ss / float(H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (r[i] * inv);
}

// out = norm(x) row by row.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  int64_t H = weight.numel();
  TORCH_CHECK(x.size(-1) == H && weight.is_contiguous(), "rms_norm: hidden size mismatch");
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  int64_t T = xc.numel() / H;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * H, wp, float(eps), H, op + t * H);
  });
  return out;
}

// residual += x; x = norm(residual), both in place (x and residual contiguous [T, H]).
void add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  check_f32(x, "x");
  check_f32(residual, "residual");
  check_f32(weight, "weight");
  int64_t H = weight.numel();
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() && x.size(-1) == H,
              "add_rms_norm_: x and residual must be contiguous with the same shape [..., hidden]");
  int64_t T = x.numel() / H;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = rp + t * H;
      float* xr = xp + t * H;
      for (int64_t i = 0; i < H; ++i) r[i] = xr[i] + r[i];
      norm_row(r, wp, float(eps), H, xr);
    }
  });
}

// ---------------------------------------------------------------------------------------
// Rotary embedding (neox style: rotate halves), in place on the first `heads` heads of each row.

void rope_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
           int64_t heads, int64_t head_dim) {
  check_f32(qk, "qk");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64, "positions must be int64");
  TORCH_CHECK(qk.dim() == 2 && qk.stride(1) == 1 && qk.size(1) >= heads * head_dim, "rope_: qk must be [T, >= heads*D]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == qk.size(0), "rope_: one position per row of qk");
  auto pos_c = positions.contiguous();  // read as a flat array below
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head_dim, "rope_: bad cos/sin table");
  int64_t T = qk.size(0), ld = qk.stride(0), half = head_dim / 2, max_pos = cos.size(0);
  float* base = qk.data_ptr<float>();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_: position out of range");
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / (heads * head_dim)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pos[t] * head_dim;
      const float* s = sp + pos[t] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = base + t * ld + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          float a = v[i], b = v[i + half];
          v[i] = a * c[i] + (-b) * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------
// Paged KV cache: [2, num_blocks, block_size, kv_heads, head_dim]

void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& cache, const torch::Tensor& slots) {
  check_f32(key, "key");
  check_f32(value, "value");
  check_f32(cache, "kv cache");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5, "kv cache must be contiguous [2, blocks, block_size, kv_heads, D]");
  int64_t hkv = cache.size(3), d = cache.size(4), row = hkv * d;
  int64_t total = cache.size(1) * cache.size(2);
  TORCH_CHECK(key.dim() == 3 && key.size(1) == hkv && key.size(2) == d && key.stride(2) == 1 && key.stride(1) == d,
              "key must be [T, kv_heads, D] with contiguous rows");
  TORCH_CHECK(value.sizes() == key.sizes() && value.stride(2) == 1 && value.stride(1) == d, "value must match key");
  int64_t T = key.size(0);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T, "store_kv: one slot per key, got ", slots.numel(), " for ", T);
  auto slots_c = slots.contiguous();  // read as a flat array below
  const int64_t* sl = slots_c.data_ptr<int64_t>();
  float* kc = cache.data_ptr<float>();
  float* vc = kc + total * row;
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < total, "store_kv: slot ", sl[t], " out of range");
    std::copy(kp + t * key.stride(0), kp + t * key.stride(0) + row, kc + sl[t] * row);
    std::copy(vp + t * value.stride(0), vp + t * value.stride(0) + row, vc + sl[t] * row);
  }
}

// exp on 16 lanes (Cephes polynomial, ~1 ulp); -inf gives 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3365447505f);
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(p, n));
}

// out = silu(gate) * up for x = [gate | up] rows (silu(g) = g / (1 + exp(-g)), as torch).
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0 && x.stride(-1) == 1, "silu_and_mul: rows [gate | up] must be contiguous");
  int64_t width = x.size(-1), half = width / 2;
  auto rows = x.reshape({-1, width});
  auto sizes = x.sizes().vec();
  sizes.back() = half;
  auto out = torch::empty(sizes, x.options());
  int64_t T = rows.size(0), ld = rows.stride(0);
  const float* xp = rows.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 32768 / width), [&](int64_t t0, int64_t t1) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = xp + t * ld;
      const float* u = g + half;
      float* o = op + t * half;
      for (int64_t i = 0; i < half; i += 16) {
        __mmask16 live = half - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (half - i)) - 1);
        __m512 gv = _mm512_maskz_loadu_ps(live, g + i);
        __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_mask_storeu_ps(o + i, live, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(live, u + i)));
      }
    }
  });
  return out;
}

// Sixteen vectors -> one vector of their sixteen sums (lane j = sum of v[j]).
inline __m512 hsum16(const __m512* v) {
  __m512 b[8], c[4];
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Which of keys j0 .. j0+15 a query may see under its tree word (keys before `cached`
// always; new token n when bit n is set).
inline uint32_t tree_lanes(uint64_t bits, int64_t j0, int64_t cached) {
  int64_t n0 = j0 - cached;
  if (n0 >= 64) return 0;
  if (n0 >= 0) return uint32_t(bits >> n0) & 0xFFFFu;
  int64_t before = -n0;  // lanes still in the cached context
  if (before >= 16) return 0xFFFFu;
  return uint32_t((bits << before) | ((uint64_t(1) << before) - 1)) & 0xFFFFu;
}

// acc[u] = acc[u] * alpha[u] + sum_j p[u][j] * V_j for NU query heads sharing a kv head:
// each value row is loaded once for all of them.
template <int NU, int DV>
inline void accumulate_values(float* acc, int64_t d, const float* vrow[16], const float (*pv)[16], const __m512* alpha) {
  for (int c = 0; c < DV; ++c) {
    __m512 a[NU];
    for (int u = 0; u < NU; ++u) a[u] = _mm512_mul_ps(_mm512_loadu_ps(acc + u * d + c * 16), alpha[u]);
    for (int jj = 0; jj < 16; ++jj) {
      __m512 v = _mm512_loadu_ps(vrow[jj] + c * 16);
      for (int u = 0; u < NU; ++u) a[u] = _mm512_fmadd_ps(_mm512_set1_ps(pv[u][jj]), v, a[u]);
    }
    for (int u = 0; u < NU; ++u) _mm512_storeu_ps(acc + u * d + c * 16, a[u]);
  }
}

// One request's query rows, all heads (head_dim = 16 * DV): online softmax over the context
// 16 keys at a time. A chunk's keys and values for every kv head are contiguous in the cache
// (per slot, kv_heads x head_dim), so the request reads them as two streams; the next chunk
// (another block, through the block table) is prefetched while this one runs. Query heads
// that share a kv head share its visibility and each value row load.
template <int DV>
void attend_request(const float* q, int64_t ldq, float* out, int64_t ldo, const float* kc, const float* vc,
                    const int32_t* table, int64_t block_size, int64_t hkv, int64_t ctx, int64_t q_len, int64_t heads,
                    const int64_t* tree, float scale) {
  constexpr int64_t d = DV * 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t cached = ctx - q_len, group = heads / hkv, nq = q_len * heads, row = hkv * d;
  thread_local std::vector<float> buf;
  buf.assign(nq * (d + 2), 0.f);
  float* acc = buf.data();  // query i = (token i / heads, head i % heads)
  float* m = acc + nq * d;
  float* l = m + nq;
  for (int64_t i = 0; i < nq; ++i) m[i] = neg_inf;
  int64_t slots[16];
  const float* vrow[16];
  __m512 part[16];
  alignas(64) float pv[8][16];
  __m512 alpha[8];
  for (int64_t j0 = 0; j0 < ctx; j0 += 16) {
    int64_t nk = std::min<int64_t>(16, ctx - j0);
    for (int64_t jj = 0; jj < 16; ++jj) {
      int64_t j = j0 + std::min<int64_t>(jj, nk - 1);  // lanes past the context repeat the last key
      slots[jj] = int64_t(table[j / block_size]) * block_size + j % block_size;
    }
    for (int64_t j = j0 + 16; j < std::min<int64_t>(j0 + 32, ctx); ++j) {
      int64_t slot = int64_t(table[j / block_size]) * block_size + j % block_size;
      for (int64_t c = 0; c < row; c += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + slot * row + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vc + slot * row + c), _MM_HINT_T0);
      }
    }
    for (int64_t qi = 0; qi < q_len; ++qi) {
      int64_t last = std::min<int64_t>(cached + qi, ctx - 1);  // causal
      if (j0 > last) continue;
      int64_t vis = std::min<int64_t>(nk, last - j0 + 1);
      uint32_t lanes = (vis >= 16 ? 0xFFFFu : (1u << vis) - 1);
      if (tree) lanes &= tree_lanes(uint64_t(tree[qi]), j0, cached);
      if (!lanes) continue;
      for (int64_t g = 0; g < hkv; ++g) {
        for (int64_t jj = 0; jj < 16; ++jj) vrow[jj] = vc + slots[jj] * row + g * d;
        for (int64_t u0 = 0; u0 < group; u0 += 8) {
          int64_t nu = std::min<int64_t>(8, group - u0);
          int64_t i0 = qi * heads + g * group + u0;
          for (int64_t u = 0; u < nu; ++u) {
            const float* qrow = q + qi * ldq + (g * group + u0 + u) * d;
            __m512 qv[DV];
            for (int c = 0; c < DV; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(qrow + c * 16), _mm512_set1_ps(scale));
            for (int64_t jj = 0; jj < 16; ++jj) {
              const float* k = kc + slots[jj] * row + g * d;
              __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
              for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), a);
              part[jj] = a;
            }
            int64_t i = i0 + u;
            __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), __mmask16(lanes), hsum16(part));
            float mnew = std::max(m[i], _mm512_reduce_max_ps(sv));
            __m512 p = exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mnew)));
            alpha[u] = exp16(_mm512_set1_ps(m[i] - mnew));
            l[i] = l[i] * _mm512_cvtss_f32(alpha[u]) + _mm512_reduce_add_ps(p);
            m[i] = mnew;
            _mm512_store_ps(pv[u], p);  // hidden lanes are 0 (and read a written slot)
          }
          float* a = acc + i0 * d;
          switch (nu) {
            case 1: accumulate_values<1, DV>(a, d, vrow, pv, alpha); break;
            case 2: accumulate_values<2, DV>(a, d, vrow, pv, alpha); break;
            case 3: accumulate_values<3, DV>(a, d, vrow, pv, alpha); break;
            case 4: accumulate_values<4, DV>(a, d, vrow, pv, alpha); break;
            case 5: accumulate_values<5, DV>(a, d, vrow, pv, alpha); break;
            case 6: accumulate_values<6, DV>(a, d, vrow, pv, alpha); break;
            case 7: accumulate_values<7, DV>(a, d, vrow, pv, alpha); break;
            default: accumulate_values<8, DV>(a, d, vrow, pv, alpha); break;
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    float* o = out + (i / heads) * ldo + (i % heads) * d;
    for (int64_t e = 0; e < d; ++e) o[e] = acc[i * d + e] * inv;
  }
}

using AttendFn = void (*)(const float*, int64_t, float*, int64_t, const float*, const float*, const int32_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t, const int64_t*, float);
constexpr AttendFn kAttend[8] = {attend_request<1>, attend_request<2>, attend_request<3>, attend_request<4>,
                                 attend_request<5>, attend_request<6>, attend_request<7>, attend_request<8>};

// out[rows of `reqs`] = attention of their queries over their paged context. Requests not in
// `reqs` are left untouched (the caller attends them another way).
void paged_attention(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& cache,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                     const torch::Tensor& query_start_loc, const c10::optional<torch::Tensor>& tree_mask,
                     const torch::Tensor& reqs, double scale) {
  check_f32(out, "out");
  check_f32(query, "query");
  check_f32(cache, "kv cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32 && reqs.scalar_type() == torch::kInt64,
              "paged_attention: int32 block tables / seq lens / query starts and int64 request indices expected");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                  reqs.is_contiguous() && cache.is_contiguous(),
              "paged_attention: metadata and cache must be contiguous");
  int64_t h = query.size(1), d = query.size(2), hkv = cache.size(3), bs = cache.size(2);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == d, "query rows must hold contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous like query");
  TORCH_CHECK(d % 16 == 0 && d <= 128 && h % hkv == 0 && cache.size(4) == d,
              "paged_attention: head_dim must be a multiple of 16, at most 128");
  const int64_t* tree = nullptr;
  if (tree_mask.has_value() && tree_mask->defined()) {
    TORCH_CHECK(tree_mask->scalar_type() == torch::kInt64 && tree_mask->is_contiguous() &&
                    tree_mask->numel() == query.size(0),
                "tree_mask must be int64, one contiguous word per query row");
    tree = tree_mask->data_ptr<int64_t>();
  }
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1 && block_tables.size(0) >= seq_lens.numel(),
              "paged_attention: query_start_loc needs num_reqs + 1 entries, block_tables a row per request");
  int64_t group = h / hkv, row = hkv * d, width = block_tables.size(1);
  const float* kc = cache.data_ptr<float>();
  const float* vc = kc + cache.size(1) * bs * row;
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = query_start_loc.data_ptr<int32_t>();
  const int64_t* rq = reqs.data_ptr<int64_t>();
  int64_t n = reqs.numel(), pairs = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t r = rq[i];
    TORCH_CHECK(r >= 0 && r < seq_lens.numel(), "paged_attention: request index out of range");
    int64_t q_len = qs[r + 1] - qs[r];
    TORCH_CHECK(qs[r] >= 0 && q_len >= 0 && qs[r + 1] <= query.size(0), "paged_attention: rows of request ", r,
                " past the query");
    TORCH_CHECK(q_len <= sl[r] && (sl[r] + bs - 1) / bs <= width, "paged_attention: bad lengths for request ", r);
    TORCH_CHECK(!tree || q_len <= 64, "paged_attention: a tree mask covers at most 64 rows");
    pairs += q_len * group * sl[r];
  }
  // A thread gets at least ~16K query-key pairs: less costs more in fork/join.
  int64_t grain = std::max<int64_t>(1, (int64_t(16384) * n + pairs * hkv - 1) / std::max<int64_t>(pairs * hkv, 1));
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t ldq = query.stride(0), ldo = out.stride(0);
  at::parallel_for(0, n, grain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      int64_t r = rq[i], start = qs[r], q_len = qs[r + 1] - start;
      if (q_len == 0) continue;
      kAttend[d / 16 - 1](qp + start * ldq, ldq, op + start * ldo, ldo, kc, vc, bt + r * width, bs, hkv, sl[r], q_len,
                          h, tree ? tree + start : nullptr, float(scale));
    }
  });
}

// ---------------------------------------------------------------------------------------
// The decoder stack of a decode step in one call: the same ops in the same order as the
// Python layer (models/decoder.py), so the result is bit for bit the same; what goes is
// the ~25 Python-level calls per layer between them.

using OptTensor = c10::optional<torch::Tensor>;

// One decoder layer's weights as the kernels take them (packed matmuls, padded biases).
struct NativeLayer {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down;
  OptTensor qkv_bias, o_bias, gate_up_bias, down_bias;
  int64_t heads, kv_heads, head_dim, hidden, intermediate;
  double eps, scale;
};

// One step's attention and rotary inputs, shared by every layer.
struct StepInputs {
  torch::Tensor positions, cos, sin, slots, block_tables, seq_lens, query_start_loc, requests;
  OptTensor tree_mask;
};

void attention_block(const NativeLayer& w, torch::Tensor& x, torch::Tensor& kv_cache, const StepInputs& in) {
  int64_t q_size = w.heads * w.head_dim, kv_size = w.kv_heads * w.head_dim, T = x.size(0);
  auto qkv = linear(x, w.qkv, w.qkv_bias, q_size + 2 * kv_size);
  auto q = qkv.narrow(1, 0, q_size);
  auto k = qkv.narrow(1, q_size, kv_size);
  auto v = qkv.narrow(1, q_size + kv_size, kv_size);
  rope_(q, in.positions, in.cos, in.sin, w.heads, w.head_dim);
  rope_(k, in.positions, in.cos, in.sin, w.kv_heads, w.head_dim);
  auto q3 = q.view({T, w.heads, w.head_dim});
  store_kv(k.view({T, w.kv_heads, w.head_dim}), v.view({T, w.kv_heads, w.head_dim}), kv_cache, in.slots);
  auto out = torch::empty(q3.sizes(), q3.options());
  paged_attention(out, q3, kv_cache, in.block_tables, in.seq_lens, in.query_start_loc, in.tree_mask, in.requests,
                  w.scale);
  x = linear(out.view({T, q_size}), w.o, w.o_bias, w.hidden);
}

// hidden [T, H] (the embeddings) -> (the last layer's output, the residual stream before it
// is added), as DecoderForCausalLM.forward's loop returns them.
std::tuple<torch::Tensor, torch::Tensor> run_layers(const std::vector<NativeLayer>& layers,
                                                    const std::vector<torch::Tensor>& kv_caches, torch::Tensor hidden,
                                                    const StepInputs& in) {
  TORCH_CHECK(!layers.empty() && kv_caches.size() == layers.size(), "run_layers: one KV cache per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "run_layers: hidden must be a contiguous [T, H]");
  torch::Tensor x = hidden, residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    const NativeLayer& w = layers[i];
    if (i == 0) {
      residual = x;
      x = rms_norm(x, w.input_norm, w.eps);
    } else {
      add_rms_norm_(x, residual, w.input_norm, w.eps);
    }
    torch::Tensor cache = kv_caches[i];
    attention_block(w, x, cache, in);
    add_rms_norm_(x, residual, w.post_norm, w.eps);
    x = linear(silu_and_mul(linear(x, w.gate_up, w.gate_up_bias, 2 * w.intermediate)), w.down, w.down_bias,
               w.hidden);
  }
  return {x, residual};
}

// The layers, converted once (per weight load), run by every decode step.
struct NativeDecoder {
  std::vector<NativeLayer> layers;
  std::tuple<torch::Tensor, torch::Tensor> run(const std::vector<torch::Tensor>& kv_caches, torch::Tensor hidden,
                                               const StepInputs& in) const {
    return run_layers(layers, kv_caches, hidden, in);
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NativeLayer>(m, "NativeLayer")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor qkv, OptTensor qkv_bias, torch::Tensor o,
                       OptTensor o_bias, torch::Tensor post_norm, torch::Tensor gate_up, OptTensor gate_up_bias,
                       torch::Tensor down, OptTensor down_bias, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t hidden, int64_t intermediate, double eps, double scale) {
             return NativeLayer{input_norm, qkv,      o,         post_norm,    gate_up, down,   qkv_bias,
                                o_bias,     gate_up_bias, down_bias, heads,  kv_heads, head_dim, hidden,
                                intermediate, eps,     scale};
           }),
           py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("o_bias"),
           py::arg("post_norm"), py::arg("gate_up"), py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"),
           py::arg("eps"), py::arg("scale"));
  py::class_<StepInputs>(m, "StepInputs")
      .def(py::init([](torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                       torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                       torch::Tensor requests, OptTensor tree_mask) {
             return StepInputs{positions, cos, sin, slots, block_tables, seq_lens, query_start_loc, requests,
                               tree_mask};
           }),
           py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("requests"), py::arg("tree_mask"));
  py::class_<NativeDecoder>(m, "NativeDecoder")
      .def(py::init([](std::vector<NativeLayer> layers) { return NativeDecoder{std::move(layers)}; }),
           py::arg("layers"))
      .def("run", &NativeDecoder::run, "the decoder layers of a step whose every request is a short span",
           py::arg("kv_caches"), py::arg("hidden"), py::arg("inputs"));
  m.doc() = "CPU kernels for the decode step (float32, AVX-512)";
  m.def("pack_weight", &pack_weight, "[N, K] -> [ceil(N/48), K, 48] blocks for linear (float32 or bfloat16)");
  m.def("linear", &linear, "y = x W^T + b over a [G, K, 48] packed weight (float32 or bfloat16), float32 x and y");
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual), in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over rows [gate | up]");
  m.def("rope_", &rope_, "neox rotary embedding in place on the first `heads` heads of each row");
  m.def("store_kv", &store_kv);
  m.def("paged_attention", &paged_attention);
  m.attr("BLOCK") = kBlock;
}
