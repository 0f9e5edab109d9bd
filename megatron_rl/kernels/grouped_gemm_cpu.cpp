// Grouped fp32 matrix products on the CPU: torch._grouped_mm's results without its per-group
// dispatch. See megatron_rl/kernels/grouped_gemm.py for what it computes and how it is checked.
//
// For each group ATen's fallback calls at::mm_out, which reaches MKL's sgemm_ through
// addmm_impl_cpu_ (the transposes and leading dimensions it derives from the strides) and
// cpublas::gemm (normalize_last_dims). This file derives the same arguments for the same
// pointers and calls sgemm_ once per group, so every product is computed by the same kernel.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

// A 2-D strided fp32 matrix.
struct Matrix {
  const float* data;
  int64_t rows, cols, stride0, stride1;
  int64_t stride(bool first) const { return first ? stride0 : stride1; }
};

// out[rows(a), cols(b)] (row stride ld_out, unit column stride) = a @ b.
void product_into(float* out, int64_t ld_out, Matrix a, Matrix b) {
  const int64_t rows = a.rows, cols = b.cols, inner = a.cols;
  if (rows == 0 || cols == 0) return;
  if (inner == 0) {  // an empty sum: at::mm_out writes zeros
    for (int64_t i = 0; i < rows; ++i) std::fill(out + i * ld_out, out + i * ld_out + cols, 0.f);
    return;
  }
  // addmm_impl_cpu_: a result with strides (ld_out, 1) is row-major unless it is one column
  // that is also column-major; a row-major result is computed as C^T = B^T A^T
  const bool transpose_c = !(ld_out == 1 && (cols == 1 || 1 >= std::max<int64_t>(1, rows)));
  const Matrix m1 = transpose_c ? b : a, m2 = transpose_c ? a : b;
  const int64_t m = transpose_c ? cols : rows;
  const int64_t n = transpose_c ? rows : cols;
  const int64_t k = transpose_c ? m1.rows : m1.cols;
  bool transpose_a, transpose_b;
  if (m1.stride(!transpose_c) == 1 && m1.stride(transpose_c) >= std::max<int64_t>(1, m)) {
    transpose_a = false;
  } else if (m1.stride(transpose_c) == 1 && m1.stride(!transpose_c) >= std::max<int64_t>(1, k)) {
    transpose_a = true;
  } else {
    TORCH_CHECK(false, "megatron_rl::grouped_mm: an operand is neither row- nor column-major");
  }
  if (m2.stride(!transpose_c) == 1 && m2.stride(transpose_c) >= std::max<int64_t>(1, k)) {
    transpose_b = false;
  } else if (m2.stride(transpose_c) == 1 && m2.stride(!transpose_c) >= std::max<int64_t>(1, n)) {
    transpose_b = true;
  } else {
    TORCH_CHECK(false, "megatron_rl::grouped_mm: an operand is neither row- nor column-major");
  }
  int64_t lda = m1.stride(transpose_a != transpose_c);
  int64_t ldb = m2.stride(transpose_b != transpose_c);
  int64_t ldc = transpose_c ? ld_out : 1;
  // cpublas::normalize_last_dims
  if (n == 1) ldc = m;
  if (transpose_a) {
    if (m == 1) lda = k;
  } else if (k == 1) {
    lda = m;
  }
  if (transpose_b) {
    if (k == 1) ldb = n;
  } else if (n == 1) {
    ldb = k;
  }
  const char ta = transpose_a ? 't' : 'n', tb = transpose_b ? 't' : 'n';
  const int mi = m, ni = n, ki = k, ldai = lda, ldbi = ldb, ldci = ldc;
  const float one = 1.f, zero = 0.f;
  sgemm_(&ta, &tb, &mi, &ni, &ki, &one, m1.data, &ldai, m2.data, &ldbi, &zero, out, &ldci);
}

// Rows padded to 16 bytes, as ATen's grouped output (create_grouped_gemm_output_tensor).
int64_t padded(int64_t cols) { return (cols + 3) / 4 * 4; }

at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && offs.device().is_cpu(),
              "megatron_rl::grouped_mm: CPU tensors only");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "megatron_rl::grouped_mm: float32 operands only");
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.dim() == 1,
              "megatron_rl::grouped_mm: offs must be a 1-D int32 tensor");
  TORCH_CHECK(a.dim() == 2 && (b.dim() == 2 || b.dim() == 3),
              "megatron_rl::grouped_mm: a 2-D x 3-D or 2-D x 2-D product");
  const at::Tensor ends = offs.contiguous();
  const int32_t* end = ends.data_ptr<int32_t>();
  const int64_t groups = ends.size(0);
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  int64_t start = 0;
  if (b.dim() == 3) {  // rows of a in groups, b[g] for group g: out [rows, cols]
    TORCH_CHECK(b.size(0) == groups && a.size(1) == b.size(1),
                "megatron_rl::grouped_mm: b needs one [inner, cols] matrix per group");
    const int64_t cols = b.size(2), ld = padded(cols);
    at::Tensor out = at::empty_strided({a.size(0), cols}, {ld, 1}, a.options());
    float* po = out.data_ptr<float>();
    for (int64_t g = 0; g < groups; ++g) {
      TORCH_CHECK(end[g] >= start && end[g] <= a.size(0), "megatron_rl::grouped_mm: bad offs");
      const Matrix ag{pa + start * a.stride(0), end[g] - start, a.size(1), a.stride(0), a.stride(1)};
      const Matrix bg{pb + g * b.stride(0), b.size(1), cols, b.stride(1), b.stride(2)};
      product_into(po + start * ld, ld, ag, bg);
      start = end[g];
    }
    return out;
  }
  // the inner dimension in groups: out[g] = a[:, group g] @ b[group g, :], out [groups, rows, cols]
  TORCH_CHECK(a.size(1) == b.size(0), "megatron_rl::grouped_mm: inner dimensions differ");
  const int64_t rows = a.size(0), cols = b.size(1), ld = padded(cols);
  at::Tensor out = at::empty_strided({groups, rows, cols}, {rows * ld, ld, 1}, a.options());
  float* po = out.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(end[g] >= start && end[g] <= a.size(1), "megatron_rl::grouped_mm: bad offs");
    const Matrix ag{pa + start * a.stride(1), rows, end[g] - start, a.stride(0), a.stride(1)};
    const Matrix bg{pb + start * b.stride(0), end[g] - start, cols, b.stride(0), b.stride(1)};
    product_into(po + g * rows * ld, ld, ag, bg);
    start = end[g];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(megatron_rl, m) {
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
  m.impl("grouped_mm", c10::DispatchKey::CPU, TORCH_FN(grouped_mm));
}
