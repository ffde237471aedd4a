// How the softmax handlers see their operands: `rows` rows of `cols` (Sk) elements, the query index of a row for the
// causal mask, and where a row's mask bytes start when a broadcast mask is read in place.
//
// Mask broadcasting by index math: the leading (row) dims of the logits are grouped into runs of consecutive dims
// that the mask either broadcasts (mask dim 1) or does not (mask dim = logits dim); dims of size 1 are dropped. A
// row's index decomposes over the groups (innermost last); the mask row is the sum of the group indices times the
// groups' strides in mask rows (0 for a broadcast group). (B, H, Sq) rows with a (B, 1, Sq) mask: groups B (stride
// Sq), H (broadcast), Sq (stride 1).
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define TE_JAX_SOFTMAX_HD __host__ __device__ __forceinline__
#else
#define TE_JAX_SOFTMAX_HD inline
#endif

namespace te_jax {

// te_jax.ops.softmax.SOFTMAX_KINDS.
enum class SoftmaxKind : int64_t { kPlain = 0, kMasked = 1, kCausal = 2 };

// Leading dims alternate at most this often between broadcast and not. Exported by both modules as
// softmax_max_mask_groups(); tests/test_geometry.py checks that it covers te_jax.ops.softmax.MAX_MASK_ROW_DIMS, the
// limit the API checks on every platform.
inline constexpr int kMaxMaskGroups = 8;

struct SoftmaxView {
  int64_t rows = 1;
  int64_t cols = 1;      // Sk
  int64_t sq = 1;        // the query dim (second to last): row r has query index q_offset + r % sq
  int num_groups = 0;    // mask groups; 0 with no mask, or a mask broadcast along every row dim
  int64_t group_size[kMaxMaskGroups] = {};
  int64_t group_stride[kMaxMaskGroups] = {};  // in mask rows; 0 for a broadcast group

  // The mask's first byte of row `row`. I is the index type of the divisions: int64_t, or uint32_t where the
  // caller knows that rows < 2^32 (a 64-bit division is several times the instructions of a 32-bit one, and the
  // CUDA kernels do this once per row in every thread of the row).
  template <typename I>
  TE_JAX_SOFTMAX_HD int64_t MaskOffset(I row) const {
    I mask_row = 0;
    for (int g = num_groups - 1; g >= 0; --g) {
      const I size = static_cast<I>(group_size[g]);
      mask_row += (row % size) * static_cast<I>(group_stride[g]);
      row /= size;
    }
    return static_cast<int64_t>(mask_row) * cols;
  }

  // Keys [0, limit) of row `row` are read: all of them, or 0..i for the causal query i. I as in MaskOffset.
  template <typename I>
  TE_JAX_SOFTMAX_HD int64_t Limit(I row, bool causal, int64_t q_offset) const {
    if (!causal) return cols;
    const int64_t n = q_offset + static_cast<int64_t>(row % static_cast<I>(sq)) + 1;
    return n < 0 ? 0 : (n < cols ? n : cols);
  }
};

// dims: the logits' dims (rank >= 2); mask_dims: the mask's (the logits' rank), or empty for no mask.
inline xla::ffi::ErrorOr<SoftmaxView> MakeSoftmaxView(xla::ffi::Span<const int64_t> dims,
                                                      xla::ffi::Span<const int64_t> mask_dims, bool masked) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (rank < 2) return xla::ffi::Error::InvalidArgument("softmax: logits must have rank >= 2");
  SoftmaxView v;
  for (int64_t i = 0; i < rank - 1; ++i) v.rows *= dims[i];
  v.cols = dims[rank - 1];
  v.sq = dims[rank - 2];
  if (!masked) return v;
  if (static_cast<int64_t>(mask_dims.size()) != rank || mask_dims[rank - 1] != v.cols) {
    return xla::ffi::Error::InvalidArgument("softmax: the mask must have the logits' rank and last dim");
  }
  int prev = -1;  // broadcast state of the last group: 1 broadcast, 0 not
  for (int64_t i = 0; i < rank - 1; ++i) {
    if (dims[i] == 1) continue;
    if (mask_dims[i] != 1 && mask_dims[i] != dims[i]) {
      return xla::ffi::Error::InvalidArgument("softmax: each mask dim must be 1 or the logits' dim");
    }
    const int broadcast = mask_dims[i] == 1 ? 1 : 0;
    if (broadcast != prev) {
      if (v.num_groups == kMaxMaskGroups) {
        return xla::ffi::Error::InvalidArgument("softmax: the mask alternates between broadcast and not too often");
      }
      v.group_size[v.num_groups++] = 1;
      prev = broadcast;
    }
    v.group_size[v.num_groups - 1] *= dims[i];
    v.group_stride[v.num_groups - 1] = broadcast ? 0 : 1;  // a marker until the strides are computed below
  }
  int64_t mask_rows = 1;  // the mask rows inside the groups after g
  for (int g = v.num_groups - 1; g >= 0; --g) {
    if (v.group_stride[g] != 0) {
      v.group_stride[g] = mask_rows;
      mask_rows *= v.group_size[g];
    }
  }
  return v;
}

// te_softmax_fwd's and te_softmax_bwd's FFI signatures after the platform's context.
template <typename B>
auto SoftmaxFwdSignature(B b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // logits: f32/bf16/f16, (..., Sq, Sk)
      .template Arg<xla::ffi::BufferR0<xla::ffi::S32>>()   // q_offset: causal query index of row 0 of Sq
      .template Arg<xla::ffi::AnyBuffer>()                 // mask: bool, logits' rank (masked), or empty
      .template Ret<xla::ffi::AnyBuffer>()                 // y: the logits' shape and dtype
      .template Attr<int64_t>("kind")                      // SOFTMAX_KINDS index: plain, masked, causal
      .template Attr<float>("scale");                      // multiplies the logits
}

template <typename B>
auto SoftmaxBwdSignature(B b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // dy: y's shape and dtype
      .template Arg<xla::ffi::AnyBuffer>()                 // y: the forward output
      .template Arg<xla::ffi::BufferR0<xla::ffi::S32>>()   // q_offset: causal query index of row 0 of Sq
      .template Ret<xla::ffi::AnyBuffer>()                 // dx: y's shape and dtype
      .template Attr<bool>("causal")                       // read and write only keys j <= i
      .template Attr<float>("scale");                      // the forward's logit scale
}

}  // namespace te_jax
