// CUDA handler for te_gemm: out[M, N] = op(lhs) @ op(rhs)^T through cuBLASLt, row-major.
//
// Operands are 2-D (the Python side folds leading dims into rows), or 3-D in the strided batched form below.
// Untransposed, lhs is (M, K) and rhs is (N, K): both K-major, the only layout Hopper's FP8 tensor-core GEMMs accept
// ("TN" in cuBLAS terms), which is why the quantize kernels produce transposed FP8 copies. The transpose flags
// (lhs (K, M), rhs (K, N)) are for bf16/fp16/fp32 operands only.
//
// FP8 operands are dequantized inside the GEMM by their scale_inv (device pointers, so no host sync): one float32 per
// tensor, or block scales (the scaling modes of te_jax/scaling_mode.h, one attribute per operand):
//   - BLOCK_1X128 / BLOCK_128X128 on Hopper (cc 9.0, cuBLAS >= 12.9): cuBLASLt's VEC128_32F and BLK128x128_32F scale
//     modes, 1D x 1D, 1D x 2D and 2D x 1D (2D x 2D has no kernel), output bf16/fp16/fp32 only. cuBLASLt's scale
//     layouts (cuBLAS documentation, "128-element 1D and 128x128 2D Block Scaling For FP8 Data Types"): a 1 x 128
//     operand's scales are (L, R) row-major, R (the operand's rows) contiguous, L = ceil(K / 128); a 128 x 128
//     operand's are (ceil(R / 128), L4) row-major with L4 = L rounded up to a multiple of 4; both 16-byte aligned.
//     The Python side (te_jax/ops/gemm_block.py) writes them in these layouts; this handler checks their sizes.
//   - MXFP8_1X32 (VEC32_UE8M0) and NVFP4_1X16 (VEC16_UE4M3, E2M1 data) on cc 10.x, both operands of the same mode, in
//     cuBLASLt's tiled layout of 128 x 4 scale tiles (the Python side swizzles them). Built here, never run on this
//     project's machines (no Blackwell GPU): the Python side selects it by compute capability.
// Optional bias epilogue (bias in the output dtype) and residual (cuBLASLt's C input with beta = 1: out = lhs @ rhs^T
// + bias + residual, in float32, rounded once; C has the output's type and layout). Fast accumulation is a per-call
// attribute: Transformer Engine's choice is fast for the forward GEMM, full precision for dgrad and wgrad.
//
// Parts: with P > 1 output buffers, rhs is (P, N, K) and out_p[M, N] = lhs . rhs[p]^T (the q, k and v projections
// of attention, each written where attention reads it). That is one launch, a cuBLASLt pointer-array batched GEMM
// (te_jax/gemm_batch.h): fewer tail waves than P GEMMs of N columns. cuBLASLt has no bias epilogue for it (its
// heuristic answers NOT_SUPPORTED), and there is no residual.
//
// Strided batched: lhs (B, M, K), rhs (B, N, K) and one output (B, M, N), out[b] = lhs[b] . rhs[b]^T, each batch
// index right after the one before (cuBLASLt's BATCH_COUNT and STRIDED_BATCH_OFFSET on every layout), one per-tensor
// scale per operand for the whole batch: the batched products of attention ('BSNH,BTNH->BNTS'), which would otherwise
// be B launches. Both operands K-major, no bias, no residual, no block scales.
//
// cuBLASLt plans (descriptors, layouts, the algorithm) are built once per device and problem and cached; the first
// call of a problem also times the heuristic's candidates and keeps the fastest. Later calls only look their plan up.
// The workspace is the first result buffer, allocated by XLA; the batched GEMM's pointer arrays follow cuBLASLt's
// 32 MiB in it. The handler is CUDA-graph compatible, so XLA can capture
// it into its command buffers with the kernels around it: the timing runs on a private stream, with private output
// and workspace buffers, so it works the same whether or not XLA's stream is being captured.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "te_jax/buffer_checks.h"
#include "te_jax/cublaslt_util.h"
#include "te_jax/cuda_check.h"
#include "te_jax/gemm_batch.h"
#include "te_jax/gemm_plans.h"
#include "te_jax/scaling_mode.h"
#include "te_jax/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace te_jax {
namespace {

// The heuristic's first choice is not always the fastest: the first call of each problem times up to this many of its
// candidates on the call's operands and keeps the fastest (once per process, a few hundred milliseconds at most).
constexpr int kCandidates = 32;
constexpr int kWarmupRuns = 5;
constexpr int kTimedRuns = 3;
// Candidates slower than the first round's best by more than this factor are not timed again.
constexpr float kSecondRoundSlack = 1.10f;

// 32 MiB: what cuBLASLt's Hopper kernels can use; smaller workspaces rule out some split-K algorithms. The workspace
// result holds this much, then the batched GEMM's pointer arrays (GemmWorkspace).
constexpr size_t kWorkspaceBytes = 32u << 20;

// The batched GEMM's A, B and D pointer arrays, 8 bytes per part each, rounded up to 256 bytes; none for one part.
size_t PointerArrayBytes(int batch) { return batch > 1 ? (3 * 8 * batch + 255) / 256 * 256 : 0; }

// The A and B scale pointers of a matmul descriptor (device pointers, so no host sync; cuBLAS's A is our rhs).
ffi::Error SetScalePointers(cublasLtMatmulDesc_t desc, const void* a_scale, const void* b_scale) {
  TE_JAX_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)),
      "A_SCALE_POINTER");
  TE_JAX_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)),
      "B_SCALE_POINTER");
  return ffi::Error::Success();
}

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, bool, bool, bool, bool, int, int, int, bool,
                           int, int, int64_t, int64_t, bool, int64_t>;

// Everything cuBLASLt needs for one problem, built once.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's choices, until the first call picks one
  cublasLtMatmulAlgo_t algo;
  int offered = 0;        // how many candidates the heuristic offered
  int chosen = 0;         // the chosen one's rank among them
  bool captured = false;  // the first call ran while the stream was being captured
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

struct Cache {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

Cache& GetCache() {
  static Cache* cache = new Cache();  // never destroyed: handles must outlive every executable
  return *cache;
}

struct Problem {
  int device;
  int64_t m, n, k;  // row-major out is (m, n), or each of the parts' outputs is
  cudaDataType_t lhs_type, rhs_type, out_type;
  bool transpose_lhs, transpose_rhs, bias, fast_accum;
  bool fp8;
  int align_lhs, align_rhs, align_out;  // pointer alignments in bytes, up to 256: the heuristic must know them
  bool residual;
  int align_residual;
  int parts;  // output buffers: 1, or the parts of a (parts, n, k) rhs
  int64_t batch = 1;  // strided batch count: lhs (batch, m, k), rhs (batch, n, k), out (batch, m, n); 1: none
  ScalingMode lhs_mode = ScalingMode::kPerTensor, rhs_mode = ScalingMode::kPerTensor;
  // The heuristic's first candidate, never timed: the same algorithm (and bits) in every process.
  bool deterministic = false;

  bool pointer_array() const { return parts > 1; }
  bool strided() const { return batch > 1; }
  bool block() const { return lhs_mode != ScalingMode::kPerTensor; }
};

// cuBLASLt's scale mode for an operand of `mode`.
cublasLtMatmulMatrixScale_t CublasScaleMode(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::kBlock1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScalingMode::kBlock128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case ScalingMode::kMxfp8_1x32: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    case ScalingMode::kNvfp4_1x16: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
    case ScalingMode::kPerTensor: break;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The elements of the scales of an operand with `rows` rows and K = `k` in cuBLASLt's layout for `mode` (see the
// top of this file), and their element type.
int64_t BlockScaleCount(ScalingMode mode, int64_t rows, int64_t k) {
  const int64_t l = CeilDiv(k, scale_block(mode).cols);
  switch (mode) {
    case ScalingMode::kBlock1x128: return l * rows;
    case ScalingMode::kBlock128x128: return CeilDiv(rows, 128) * CeilDiv(l, 4) * 4;
    case ScalingMode::kMxfp8_1x32:
    case ScalingMode::kNvfp4_1x16: return CeilDiv(rows, 128) * 128 * CeilDiv(l, 4) * 4;  // whole 128 x 4 tiles
    case ScalingMode::kPerTensor: break;
  }
  return 1;
}

ffi::DataType BlockScaleType(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::kMxfp8_1x32: return ffi::DataType::F8E8M0FNU;
    case ScalingMode::kNvfp4_1x16: return ffi::DataType::F8E4M3FN;
    default: return ffi::DataType::F32;
  }
}

// `value` as a ScalingMode, or an error naming the attribute.
ffi::ErrorOr<ScalingMode> ModeOf(int64_t value, const char* name) {
  for (const auto& m : kScalingModes) {
    if (static_cast<int64_t>(m.mode) == value) return m.mode;
  }
  return ffi::Error::InvalidArgument(std::string("gemm: ") + name + " = " + std::to_string(value) +
                                     " is no te_jax ScalingMode");
}

// The largest power of two up to 256 dividing v: of an address, or of a byte offset added to every address.
int Alignment(uintptr_t v) {
  int a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}
int Alignment(const void* p) { return Alignment(reinterpret_cast<uintptr_t>(p)); }

// The output buffers of one call: one, or one per part of rhs.
struct Outs {
  void* part[kMaxGemmParts] = {};
};

// Row-major out[m, n] = lhs . rhs^T is column-major out^T[n, m] = rhs . lhs^T, so cuBLAS's A is our rhs and its B
// our lhs. Untransposed rhs (n, k) row-major is a column-major (k, n) matrix used transposed (TRANSA = T);
// untransposed lhs (m, k) is column-major (k, m) used as is (TRANSB = N).
// The scale and bias pointers are this call's: cuBLASLt's heuristic rejects block scale modes without scale pointers
// (CUBLAS_STATUS_INVALID_VALUE); each call sets its own before it runs.
ffi::ErrorOr<Plan*> GetPlan(cublasLtHandle_t handle, const Problem& p, Cache& cache, const void* a_scale,
                            const void* b_scale, const void* bias_ptr) {
  const PlanKey key{p.device,    p.m,         p.n,         p.k,         p.lhs_type,  p.rhs_type, p.out_type,
                    p.transpose_lhs, p.transpose_rhs, p.bias, p.fast_accum, p.align_lhs, p.align_rhs, p.align_out,
                    p.residual,  p.align_residual, p.parts, static_cast<int64_t>(p.lhs_mode),
                    static_cast<int64_t>(p.rhs_mode), p.deterministic, p.batch};
  auto it = cache.plans.find(key);
  if (it != cache.plans.end()) return it->second.get();

  auto plan = std::make_unique<Plan>();
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                "matmul descriptor");
  const cublasOperation_t op_a = p.transpose_rhs ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_b = p.transpose_lhs ? CUBLAS_OP_T : CUBLAS_OP_N;
  TE_JAX_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)), "TRANSA");
  TE_JAX_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)), "TRANSB");
  if (p.fp8 && p.lhs_type != CUDA_R_4F_E2M1) {  // FAST_ACCUM is an FP8 attribute
    const int8_t fast = p.fast_accum ? 1 : 0;
    TE_JAX_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
        "FAST_ACCUM");
  }
  if (p.block()) {  // cuBLAS's A is our rhs, its B our lhs
    const int32_t mode_a = CublasScaleMode(p.rhs_mode), mode_b = CublasScaleMode(p.lhs_mode);
    TE_JAX_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)),
        "A_SCALE_MODE");
    TE_JAX_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)),
        "B_SCALE_MODE");
  }
  if (p.fp8) {
    if (auto err = SetScalePointers(plan->desc, a_scale, b_scale); err.failure()) return err;
  }
  if (p.bias) {
    TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                 &bias_ptr, sizeof(bias_ptr)),
                                  "BIAS_POINTER");
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    TE_JAX_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
        "EPILOGUE");
    const cudaDataType_t bias_type = p.out_type;
    TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                                 &bias_type, sizeof(bias_type)),
                                  "BIAS_DATA_TYPE");
  }
  // Column-major shapes (rows, cols, leading dim) of the stored matrices (of each part's, batched).
  const int64_t a_rows = p.transpose_rhs ? p.n : p.k, a_cols = p.transpose_rhs ? p.k : p.n;
  const int64_t b_rows = p.transpose_lhs ? p.m : p.k, b_cols = p.transpose_lhs ? p.k : p.m;
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->a, p.rhs_type, a_rows, a_cols, a_rows), "layout A");
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, p.lhs_type, b_rows, b_cols, b_rows), "layout B");
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->d, p.out_type, p.n, p.m, p.n), "layout D");
  if (p.strided()) {  // each batch index one matrix's size after the one before
    const int32_t count = static_cast<int32_t>(p.batch);
    const std::pair<cublasLtMatrixLayout_t, int64_t> strides[] = {
        {plan->a, a_rows * a_cols}, {plan->b, b_rows * b_cols}, {plan->d, p.n * p.m}};
    for (const auto& [layout, stride] : strides) {
      TE_JAX_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
          "BATCH_COUNT");
      const auto offset = CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET;
      TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(layout, offset, &stride, sizeof(stride)),
                                    "STRIDED_BATCH_OFFSET");
    }
  }
  if (p.pointer_array()) {
    const int32_t count = p.parts;
    const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    for (cublasLtMatrixLayout_t layout : {plan->a, plan->b, plan->d}) {
      TE_JAX_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
          "BATCH_COUNT");
      TE_JAX_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode)),
          "BATCH_MODE");
    }
  }

  cublasLtMatmulPreference_t pref;
  TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const uint64_t ws = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const uint32_t align_a = p.align_rhs, align_b = p.align_lhs, align_d = p.align_out;
  const uint32_t align_c = p.residual ? p.align_residual : p.align_out;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d));
  cublasLtMatmulHeuristicResult_t results[kCandidates];
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d,
                                                               pref, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  TE_JAX_CUBLAS_RETURN_IF_ERROR(status, "algorithm heuristic");
  if (found == 0) {
    return ffi::Error::InvalidArgument("gemm: cuBLASLt has no algorithm for m=" + std::to_string(p.m) +
                                       " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k) +
                                       (p.pointer_array() ? " in " + std::to_string(p.parts) + " parts" : "") +
                                       (p.strided() ? " in a batch of " + std::to_string(p.batch) : std::string()) +
                                       (p.block() ? " with block scales (modes " +
                                                        std::to_string(static_cast<int64_t>(p.lhs_mode)) + " x " +
                                                        std::to_string(static_cast<int64_t>(p.rhs_mode)) + ")"
                                                  : std::string()) +
                                       " with these types/layout");
  }
  plan->offered = found;
  for (int i = 0; i < found; ++i) plan->candidates.push_back(results[i].algo);
  Plan* raw = plan.get();
  cache.plans.emplace(key, std::move(plan));
  return raw;
}

// Times each candidate and returns the fastest, on a private stream with private output and workspace buffers; the
// operands are read where they are (only the timing depends on their contents). So it runs the same while XLA's stream
// is being captured into a CUDA graph (an XLA command buffer), which forbids synchronizing that stream but not work
// on another; the thread's capture mode is relaxed meanwhile, for the allocations and the event waits. The GPU is
// warmed up first (its clocks ramp up under load, which would favour candidates timed late); then every candidate is
// timed over kTimedRuns runs between two events, and those within kSecondRoundSlack of the best once more, each
// keeping its faster round. Candidates that fail to run are skipped; where the private stream or buffers cannot be
// had, the heuristic's first choice stays. Returns the fastest one's index.
template <typename Run>
size_t FastestAlgorithm(const std::vector<cublasLtMatmulAlgo_t>& candidates, size_t part_bytes, int parts,
                        size_t workspace_bytes, Run&& run) {
  RelaxedCapture relaxed;
  cudaStream_t stream = nullptr;
  void* out = nullptr;
  void* workspace = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<float> ms(candidates.size(), -1.0f);
  const bool ready = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
                     cudaMallocAsync(&out, part_bytes * parts, stream) == cudaSuccess &&
                     cudaMallocAsync(&workspace, workspace_bytes, stream) == cudaSuccess &&
                     cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess;
  Outs outs;
  for (int i = 0; ready && i < parts; ++i) outs.part[i] = static_cast<char*>(out) + i * part_bytes;
  if (ready) {
    auto time = [&](const cublasLtMatmulAlgo_t& algo) {
      cudaEventRecord(start, stream);
      bool ok = true;
      for (int r = 0; r < kTimedRuns && ok; ++r) ok = run(algo, stream, outs, workspace) == CUBLAS_STATUS_SUCCESS;
      cudaEventRecord(stop, stream);
      float t = -1.0f;
      if (!ok || cudaEventSynchronize(stop) != cudaSuccess || cudaEventElapsedTime(&t, start, stop) != cudaSuccess) {
        return -1.0f;
      }
      return t;
    };
    for (int r = 0; r < kWarmupRuns; ++r) run(candidates[0], stream, outs, workspace);
    float best = -1.0f;
    for (size_t i = 0; i < candidates.size(); ++i) {
      ms[i] = time(candidates[i]);
      if (ms[i] >= 0.0f && (best < 0.0f || ms[i] < best)) best = ms[i];
    }
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (ms[i] < 0.0f || ms[i] > best * kSecondRoundSlack) continue;
      const float t = time(candidates[i]);
      if (t >= 0.0f && t < ms[i]) ms[i] = t;
    }
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (workspace) cudaFreeAsync(workspace, stream);
  if (out) cudaFreeAsync(out, stream);
  if (stream) {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }
  (void)cudaGetLastError();  // a candidate that failed to launch must not fail the call
  size_t fastest = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (ms[i] >= 0.0f && (ms[fastest] < 0.0f || ms[i] < ms[fastest])) fastest = i;
  }
  return fastest;
}

ffi::Error GemmCuda(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale_inv,
                    ffi::AnyBuffer rhs_scale_inv, ffi::AnyBuffer bias, ffi::AnyBuffer residual,
                    ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets out_rets, bool transpose_lhs,
                    bool transpose_rhs, bool fast_accum, int64_t lhs_scaling_mode, int64_t rhs_scaling_mode,
                    bool deterministic) {
  const size_t parts = out_rets.size();
  if (parts < 1 || parts > static_cast<size_t>(kMaxGemmParts)) {
    return ffi::Error::InvalidArgument("gemm: 1 to " + std::to_string(kMaxGemmParts) + " outputs, got " +
                                       std::to_string(parts));
  }
  std::vector<ffi::Result<ffi::AnyBuffer>> outs;
  for (size_t i = 0; i < parts; ++i) {
    auto out = out_rets.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return out.error();
    outs.push_back(*out);
  }
  ffi::Result<ffi::AnyBuffer>& out = outs[0];
  // rhs: (N, K) (or (K, N) transposed); with parts, (parts, N, K), untransposed. A 3-D lhs (B, M, K) is the strided
  // batched form: rhs (B, N, K) and one output (B, M, N), untransposed.
  const auto ldims = lhs.dimensions();
  const auto rdims = rhs.dimensions();
  const bool batched = ldims.size() == 3;
  const size_t lhs_rank = batched ? 3 : 2, rhs_rank = parts > 1 || batched ? 3 : 2;
  const bool parts_ok = parts == 1 || (rdims.size() == 3 && !transpose_rhs && rdims[0] == static_cast<int64_t>(parts));
  const bool batch_ok = !batched || (parts == 1 && rdims.size() == 3 && rdims[0] == ldims[0] && !transpose_lhs &&
                                     !transpose_rhs);
  if (ldims.size() != lhs_rank || rdims.size() != rhs_rank || !parts_ok || !batch_ok) {
    return ffi::Error::InvalidArgument(
        "gemm: lhs must be 2-D and rhs 2-D, or (parts, n, k) with parts outputs; or lhs (b, m, k), rhs (b, n, k), "
        "untransposed, with one output");
  }
  Problem p;
  TE_JAX_CUDA_RETURN_IF_ERROR(cudaGetDevice(&p.device), "cudaGetDevice");
  p.batch = batched ? ldims[0] : 1;
  p.m = transpose_lhs ? ldims[1] : ldims[lhs_rank - 2];
  p.k = transpose_lhs ? ldims[0] : ldims[lhs_rank - 1];
  p.n = transpose_rhs ? rdims[1] : rdims[rhs_rank - 2];
  p.parts = static_cast<int>(parts);
  const int64_t k_rhs = transpose_rhs ? rdims[0] : rdims[rhs_rank - 1];
  if (k_rhs != p.k) return ffi::Error::InvalidArgument("gemm: operand shapes do not agree");
  for (const auto& o : outs) {
    const auto od = o->dimensions();
    if (od.size() != lhs_rank || (batched && od[0] != p.batch) || od[lhs_rank - 2] != p.m ||
        od[lhs_rank - 1] != p.n || o->element_type() != out->element_type()) {
      return ffi::Error::InvalidArgument("gemm: every output must be (m, n), or (b, m, n) batched, of one dtype");
    }
  }
  auto lhs_type = CublasType(lhs.element_type(), "gemm");
  auto rhs_type = CublasType(rhs.element_type(), "gemm");
  auto out_type = CublasType(out->element_type(), "gemm");
  if (lhs_type.has_error()) return lhs_type.error();
  if (rhs_type.has_error()) return rhs_type.error();
  if (out_type.has_error()) return out_type.error();
  p.lhs_type = *lhs_type;
  p.rhs_type = *rhs_type;
  p.out_type = *out_type;
  auto lhs_mode = ModeOf(lhs_scaling_mode, "lhs_scaling_mode");
  auto rhs_mode = ModeOf(rhs_scaling_mode, "rhs_scaling_mode");
  if (lhs_mode.has_error()) return lhs_mode.error();
  if (rhs_mode.has_error()) return rhs_mode.error();
  p.lhs_mode = *lhs_mode;
  p.rhs_mode = *rhs_mode;
  const bool fp4 = lhs.element_type() == ffi::DataType::F4E2M1FN || rhs.element_type() == ffi::DataType::F4E2M1FN;
  p.fp8 = IsFp8(lhs.element_type()) || IsFp8(rhs.element_type()) || fp4;
  if (p.fp8 && (transpose_lhs || transpose_rhs)) {
    return ffi::Error::InvalidArgument("gemm: FP8 operands must both be K-major (no transpose flags)");
  }
  if ((p.lhs_mode == ScalingMode::kPerTensor) != (p.rhs_mode == ScalingMode::kPerTensor) || (p.block() && !p.fp8) ||
      (p.block() && (p.pointer_array() || batched)) || (p.block() && fast_accum)) {
    return ffi::Error::InvalidArgument(
        "gemm: block scales need both operands block-scaled, low-precision data, one output, no batch and no fast "
        "accumulation (cuBLASLt has no such kernel: its heuristic answers NOT_SUPPORTED)");
  }
  // The scale buffers: float32 scalars per tensor; block scales of the cuBLASLt layout's size, 16-byte aligned.
  for (const auto& [buf, mode, rows, name] :
       {std::make_tuple(&lhs_scale_inv, p.lhs_mode, p.m, "lhs"),
        std::make_tuple(&rhs_scale_inv, p.rhs_mode, p.n, "rhs")}) {
    if (mode == ScalingMode::kPerTensor) {
      if (p.fp8 && (buf->element_type() != ffi::DataType::F32 || buf->element_count() != 1)) {
        return ffi::Error::InvalidArgument(std::string("gemm: ") + name + "_scale_inv must be one float32");
      }
      continue;
    }
    const int64_t want = BlockScaleCount(mode, rows, p.k);
    if (buf->element_type() != BlockScaleType(mode) || Count(*buf) != want || Alignment(buf->untyped_data()) < 16) {
      return ffi::Error::InvalidArgument(std::string("gemm: ") + name + "_scale_inv must hold " + std::to_string(want) +
                                         " scales of its mode's type in cuBLASLt's layout, 16-byte aligned; got " +
                                         std::to_string(Count(*buf)));
    }
  }
  // E2M1 data: XLA stores two elements per byte.
  for (const auto* buf : {&lhs, &rhs}) {
    if (buf->element_type() == ffi::DataType::F4E2M1FN && buf->size_bytes() * 2 != buf->element_count()) {
      return ffi::Error::InvalidArgument("gemm: E2M1 operands must be packed two elements per byte");
    }
  }
  p.transpose_lhs = transpose_lhs;
  p.transpose_rhs = transpose_rhs;
  p.bias = bias.element_count() > 0;
  p.fast_accum = fast_accum;
  p.deterministic = deterministic;
  // Batched, each part of rhs starts n * k elements after the one before (strided, each batch index of every operand
  // one matrix after the one before): its alignment is also that step's.
  const size_t lhs_step = p.m * p.k * ffi::ByteWidth(lhs.element_type());
  const size_t rhs_step = p.n * p.k * ffi::ByteWidth(rhs.element_type());
  const size_t out_step = p.m * p.n * ffi::ByteWidth(out->element_type());
  p.align_lhs = std::min(Alignment(lhs.untyped_data()), p.strided() ? Alignment(lhs_step) : 256);
  p.align_rhs = std::min(Alignment(rhs.untyped_data()),
                         p.pointer_array() || p.strided() ? Alignment(rhs_step) : 256);
  p.align_out = p.strided() ? Alignment(out_step) : 256;
  for (const auto& o : outs) p.align_out = std::min(p.align_out, Alignment(o->untyped_data()));
  if (p.bias && (p.pointer_array() || batched || bias.element_count() != p.n ||
                 bias.element_type() != out->element_type())) {
    return ffi::Error::InvalidArgument("gemm: bias must be empty or (n,) in the output dtype, one unbatched output");
  }
  p.residual = residual.element_count() > 0;
  p.align_residual = p.residual ? Alignment(residual.untyped_data()) : 0;
  if (p.residual && (p.pointer_array() || batched || static_cast<int64_t>(residual.element_count()) != p.m * p.n ||
                     residual.element_type() != out->element_type())) {
    return ffi::Error::InvalidArgument("gemm: residual must be empty or (m, n) in the output dtype, one unbatched "
                                       "output");
  }
  if (p.m == 0 || p.n == 0 || p.batch == 0) return ffi::Error::Success();
  if (p.k == 0) {  // the Python side adds bias and residual itself when K = 0
    for (const auto& o : outs) {
      TE_JAX_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(o->untyped_data(), 0, o->size_bytes(), stream),
                                  "gemm: zero-K memset");
    }
    return ffi::Error::Success();
  }

  const size_t workspace_bytes = static_cast<size_t>(GemmWorkspace(p.parts).count);
  if (workspace->size_bytes() < workspace_bytes || Alignment(workspace->untyped_data()) < 256) {
    return ffi::Error::InvalidArgument("gemm: the workspace must be a 256-byte aligned buffer of " +
                                       std::to_string(workspace_bytes) + " bytes (te_jax._te_cuda.gemm_workspace)");
  }
  Cache& cache = GetCache();
  // Held through the launch: the cached descriptor carries this call's scale and bias pointers.
  std::lock_guard<std::mutex> lock(cache.mu);
  cublasLtHandle_t handle;
  Plan* plan;
  {
    RelaxedCapture relaxed;
    auto h = cache.handles.find(p.device);
    if (h == cache.handles.end()) {
      TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle), "create handle");
      cache.handles.emplace(p.device, handle);
    } else {
      handle = h->second;
    }
    auto got = GetPlan(handle, p, cache, rhs_scale_inv.untyped_data(), lhs_scale_inv.untyped_data(),
                       bias.untyped_data());
    if (got.has_error()) return got.error();
    plan = *got;
  }
  if (p.fp8) {
    const void* a_scale = rhs_scale_inv.untyped_data();
    const void* b_scale = lhs_scale_inv.untyped_data();
    if (auto err = SetScalePointers(plan->desc, a_scale, b_scale); err.failure()) return err;
  }
  if (p.bias) {
    const void* bias_ptr = bias.untyped_data();
    TE_JAX_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                 &bias_ptr, sizeof(bias_ptr)),
                                  "BIAS_POINTER");
  }
  const float alpha = 1.0f, beta = p.residual ? 1.0f : 0.0f;
  auto run = [&](const cublasLtMatmulAlgo_t& algo, cudaStream_t on, const Outs& o, void* ws) -> cublasStatus_t {
    if (!p.pointer_array()) {  // one GEMM, or a strided batch of them
      const void* c = p.residual ? residual.untyped_data() : o.part[0];
      return cublasLtMatmul(handle, plan->desc, &alpha, rhs.untyped_data(), plan->a, lhs.untyped_data(), plan->b,
                            &beta, c, plan->d, o.part[0], plan->d, &algo, ws, kWorkspaceBytes, on);
    }
    // The pointer arrays, after cuBLASLt's part of the workspace: A's, B's, then D's (also C's, unread at beta 0).
    void** arrays = reinterpret_cast<void**>(static_cast<char*>(ws) + kWorkspaceBytes);
    GemmBatchPointers ptrs{static_cast<const char*>(rhs.untyped_data()), static_cast<int64_t>(rhs_step),
                           static_cast<const char*>(lhs.untyped_data()), {}, p.parts};
    for (int i = 0; i < p.parts; ++i) ptrs.out[i] = o.part[i];
    const void** a = const_cast<const void**>(arrays);
    const void** b = const_cast<const void**>(arrays + p.parts);
    void** d = arrays + 2 * p.parts;
    if (LaunchGemmBatchPointers(ptrs, a, b, d, on) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    return cublasLtMatmul(handle, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, d, plan->d, d, plan->d, &algo,
                          ws, kWorkspaceBytes, on);
  };
  if (!plan->candidates.empty()) {
    // Chosen once, at the problem's first call, so that the algorithm (and with it the bits) never changes under a
    // program that already ran it. Timing picks the fastest, which near-ties can make another one in another
    // process; deterministic runs keep the heuristic's first (rank 0), which depends only on the problem.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TE_JAX_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture), "gemm: stream capture status");
    plan->captured = capture != cudaStreamCaptureStatusNone;
    if (plan->candidates.size() > 1 && !p.deterministic) {
      plan->chosen = static_cast<int>(
          FastestAlgorithm(plan->candidates, out->size_bytes(), p.parts, workspace_bytes, run));
    }
    plan->algo = plan->candidates[plan->chosen];
    plan->candidates.clear();
  }
  Outs real;
  for (int i = 0; i < p.parts; ++i) real.part[i] = outs[i]->untyped_data();
  TE_JAX_CUBLAS_RETURN_IF_ERROR(run(plan->algo, stream, real, workspace->untyped_data()), "matmul");
  return LastCudaError("gemm");
}

const char* TypeName(int t) {
  switch (static_cast<cudaDataType_t>(t)) {
    case CUDA_R_32F: return "float32";
    case CUDA_R_16BF: return "bfloat16";
    case CUDA_R_16F: return "float16";
    case CUDA_R_8F_E4M3: return "float8_e4m3fn";
    case CUDA_R_8F_E5M2: return "float8_e5m2";
    case CUDA_R_4F_E2M1: return "float4_e2m1fn";
    default: return "unknown";
  }
}

}  // namespace

// cuBLASLt's part, then the pointer arrays: the handler carves them in this order.
WorkspaceSize GemmWorkspace(int parts) {
  return {static_cast<int64_t>(kWorkspaceBytes + PointerArrayBytes(parts)), ffi::DataType::U8};
}

std::vector<GemmPlanInfo> GemmPlans() {
  Cache& cache = GetCache();
  std::lock_guard<std::mutex> lock(cache.mu);
  std::vector<GemmPlanInfo> infos;
  for (const auto& [key, plan] : cache.plans) {
    infos.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key), std::get<3>(key), std::get<16>(key),
                     std::get<20>(key), TypeName(std::get<4>(key)), TypeName(std::get<5>(key)),
                     TypeName(std::get<6>(key)), std::get<10>(key), plan->offered, plan->chosen, std::get<19>(key),
                     plan->captured});
  }
  return infos;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCudaHandler, GemmCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<ffi::AnyBuffer>()                     // lhs: (M, K), (K, M), (B, M, K)
                                  .Arg<ffi::AnyBuffer>()                     // rhs: (N, K), (K, N), (P|B, N, K)
                                  .Arg<ffi::AnyBuffer>()                     // lhs_scale_inv: f32[] or block scales
                                  .Arg<ffi::AnyBuffer>()                     // rhs_scale_inv: f32[] or block scales
                                  .Arg<ffi::AnyBuffer>()                     // bias: (N,) in out dtype, or empty
                                  .Arg<ffi::AnyBuffer>()                     // residual: (M, N) in out dtype, or empty
                                  .Ret<ffi::AnyBuffer>()                     // workspace: u8[GemmWorkspace(P)]
                                  .RemainingRets()                           // out (M, N) or (B, M, N), or P
                                  .Attr<bool>("transpose_lhs")               // lhs stored (K, M)
                                  .Attr<bool>("transpose_rhs")               // rhs stored (K, N)
                                  .Attr<bool>("fast_accum")                  // FP8 fast accumulation
                                  .Attr<int64_t>("lhs_scaling_mode")         // ScalingMode of lhs's scales
                                  .Attr<int64_t>("rhs_scaling_mode")         // ScalingMode of rhs's scales
                                  .Attr<bool>("deterministic"),              // heuristic's algorithm, untimed
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
