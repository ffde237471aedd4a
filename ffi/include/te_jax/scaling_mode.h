// How a quantized tensor's scales cover its data: the kernels' names for te_jax.ScalingMode
// (te_jax/_core/quantized_tensor.py), with the same numbers, which the Python side passes as an int64 attribute.
// tests/test_geometry.py checks that both sides agree (the extension modules export this table).
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

namespace te_jax {

enum class ScalingMode : int64_t {
  kPerTensor = 0,     // one float32 scale for the whole tensor
  kBlock1x128 = 1,    // one float32 scale per 1 x 128 elements of a row
  kBlock128x128 = 2,  // one float32 scale per 128 x 128 elements
  kMxfp8_1x32 = 3,    // one E8M0 scale (a power of two) per 1 x 32 elements of a row
  kNvfp4_1x16 = 4,    // one E4M3 scale per 1 x 16 elements of a row, times one float32 global scale
};

struct ScaleBlock {
  int64_t rows;  // 0: the whole tensor
  int64_t cols;
};

// The block one scale covers over the data's last two dims (rows 1: within a row).
constexpr ScaleBlock scale_block(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::kBlock1x128: return {1, 128};
    case ScalingMode::kBlock128x128: return {128, 128};
    case ScalingMode::kMxfp8_1x32: return {1, 32};
    case ScalingMode::kNvfp4_1x16: return {1, 16};
    case ScalingMode::kPerTensor: break;
  }
  return {0, 0};
}

struct ScalingModeName {
  const char* name;
  ScalingMode mode;
};

// Every mode by the name te_jax.ScalingMode gives it.
inline constexpr ScalingModeName kScalingModes[] = {
    {"PER_TENSOR", ScalingMode::kPerTensor},   {"BLOCK_1X128", ScalingMode::kBlock1x128},
    {"BLOCK_128X128", ScalingMode::kBlock128x128}, {"MXFP8_1X32", ScalingMode::kMxfp8_1x32},
    {"NVFP4_1X16", ScalingMode::kNvfp4_1x16},
};

// (name, number, block rows, block cols) of every mode: what the extension modules export as scaling_modes().
inline std::vector<std::tuple<const char*, int64_t, int64_t, int64_t>> scaling_mode_table() {
  std::vector<std::tuple<const char*, int64_t, int64_t, int64_t>> out;
  for (const auto& m : kScalingModes) {
    const auto block = scale_block(m.mode);
    out.emplace_back(m.name, static_cast<int64_t>(m.mode), block.rows, block.cols);
  }
  return out;
}

}  // namespace te_jax
