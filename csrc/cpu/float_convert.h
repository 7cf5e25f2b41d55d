// bfloat16 / float16 <-> float conversions for the CPU kernel, round-to-nearest-even, with
// subnormals, infinities and NaN handled. Written out here so csrc/ needs no torch headers.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../flash_dma_params.h"

namespace flexdma {
namespace cpu {

// Storage types: the kernel reads and writes the 16 bits, all math is done in float.
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(bf16_t x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }

inline bf16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  // Adding 0x7fff plus the lowest kept bit rounds half-way cases to the even neighbour.
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}

inline float fp16_to_float(fp16_t x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal half: shift the mantissa up until its leading 1 is the implicit bit.
    exp = 113;  // 127 - 15 + 1
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    return bits_float(sign | (exp << 23) | ((mant & 0x3ffu) << 13));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline fp16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp16_t{static_cast<uint16_t>(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return fp16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero): value / 2^-24 rounded to an integer, RNE by hand.
    if (a < 0x33000000u) return fp16_t{sign};  // below half the smallest subnormal (2^-25): 0
    const uint32_t e = a >> 23;                // 102 .. 112
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14 .. 24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return fp16_t{static_cast<uint16_t>(sign | q)};
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even; a carry
  // out of the mantissa correctly bumps the exponent (up to inf at the top).
  uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return fp16_t{static_cast<uint16_t>(sign | h)};
}

// The element types the kernel is templated on, and how each is read into / written from the
// accumulation type (float, double for double).
template <class T>
struct Elem;
template <>
struct Elem<float> {
  using acc = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
template <>
struct Elem<double> {
  using acc = double;
  static double load(double x) { return x; }
  static double store(double x) { return x; }
};
template <>
struct Elem<bf16_t> {
  using acc = float;
  static float load(bf16_t x) { return bf16_to_float(x); }
  static bf16_t store(float x) { return float_to_bf16(x); }
};
template <>
struct Elem<fp16_t> {
  using acc = float;
  static float load(fp16_t x) { return fp16_to_float(x); }
  static fp16_t store(float x) { return float_to_fp16(x); }
};

// f(static_cast<T*>(nullptr)) with T the element type of `dtype` (a tag: the callee names the type
// as std::remove_pointer_t<decltype(tag)>): one switch for every templated entry point.
template <class F>
decltype(auto) visit_elem(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(static_cast<float*>(nullptr));
    case DType::kFloat64:
      return f(static_cast<double*>(nullptr));
    case DType::kBFloat16:
      return f(static_cast<bf16_t*>(nullptr));
    case DType::kFloat16:
      return f(static_cast<fp16_t*>(nullptr));
  }
  throw std::invalid_argument("flexdma cpu: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace cpu
}  // namespace flexdma
