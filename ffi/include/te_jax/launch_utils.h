// Host-side helpers the CUDA launchers share: pointer alignment, and dispatch from run-time values to the template
// arguments of a kernel.
#pragma once

#include <cstdint>
#include <type_traits>

namespace te_jax {

inline bool Aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// Calls f(std::true_type) or f(std::false_type).
template <typename F>
void DispatchBool(bool v, F&& f) {
  if (v) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Calls f(std::integral_constant<int, n>) for the n in kNs equal to v.
template <int... kNs, typename F>
void DispatchN(int v, F&& f) {
  ((v == kNs ? (f(std::integral_constant<int, kNs>{}), 0) : 0), ...);
}

}  // namespace te_jax
